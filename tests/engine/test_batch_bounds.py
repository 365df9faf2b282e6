"""The stream's batch bounds: halved after a failure down to one transaction, grown back after successes."""

from __future__ import annotations

from cdc_assets.engine.batch_bounds import (
    BatchBounds,
    after_failure,
    after_success,
    recover_in_flight,
    with_in_flight,
)

CONFIGURED = BatchBounds(max_changes=500_000, max_bytes=256 << 20)


def test_a_failure_halves_what_the_failed_batch_held() -> None:
    shrunk = after_failure(CONFIGURED, changes=1000, bytes_=100 << 20, reason="heap")
    assert (shrunk.max_changes, shrunk.max_bytes, shrunk.failures, shrunk.reason) == (500, 50 << 20, 1, "heap")


def test_a_failure_of_a_batch_larger_than_its_bounds_halves_the_bounds() -> None:
    # one transaction larger than both bounds (read whole): the bounds halve, not what it held
    shrunk = after_failure(CONFIGURED, changes=2_000_000, bytes_=4 << 30, reason="heap")
    assert (shrunk.max_changes, shrunk.max_bytes) == (250_000, 128 << 20)


def test_repeated_failures_end_at_one_transaction_and_stay_there() -> None:
    bounds = CONFIGURED
    for attempt in range(40):
        bounds = after_failure(bounds, None, None, f"attempt {attempt}")
    assert (bounds.max_changes, bounds.max_bytes, bounds.failures) == (1, 1, 40)
    assert after_failure(bounds, 5, 10 << 20, "again").max_changes == 1


def test_successes_double_the_bounds_back_while_batches_are_cut_and_restore_them_when_not() -> None:
    bounds = after_failure(after_failure(CONFIGURED, 1000, 1 << 20, "x"), 400, 1 << 19, "x")
    assert (bounds.max_changes, bounds.max_bytes, bounds.failures) == (200, 1 << 18, 2)
    grown = after_success(bounds, CONFIGURED, cut=True)
    assert (grown.max_changes, grown.max_bytes, grown.failures, grown.reason) == (400, 1 << 19, 0, "x")
    for _ in range(30):
        grown = after_success(grown, CONFIGURED, cut=True)
    assert grown == CONFIGURED
    assert after_success(bounds, CONFIGURED, cut=False) == CONFIGURED  # it read all there was


def test_a_batch_whose_process_died_is_retried_once_at_its_bounds_then_halved() -> None:
    marked = with_in_flight(CONFIGURED, changes=800, bytes_=64 << 20)
    stored = BatchBounds.from_json(marked.to_json(), CONFIGURED)
    assert stored.in_flight == {"changes": 800, "bytes": 64 << 20}
    retried = recover_in_flight(stored)  # a death alone may be an operator's kill: the same bounds once more
    assert (retried.max_changes, retried.max_bytes, retried.failures) == (CONFIGURED.max_changes,
                                                                          CONFIGURED.max_bytes, 1)  # fmt: skip
    assert retried.in_flight is None and "died" in (retried.reason or "")
    died_again = recover_in_flight(with_in_flight(retried, changes=800, bytes_=64 << 20))
    assert (died_again.max_changes, died_again.max_bytes, died_again.failures) == (400, 32 << 20, 2)
    assert recover_in_flight(CONFIGURED) == CONFIGURED


def test_deaths_at_random_between_successes_never_shrink_the_bounds() -> None:
    bounds = CONFIGURED
    for _ in range(50):  # every other batch killed: each death is followed by a success
        bounds = recover_in_flight(with_in_flight(bounds, changes=300, bytes_=1 << 20))
        assert not bounds.shrunk(CONFIGURED)
        bounds = after_success(bounds, CONFIGURED, cut=True)
    assert bounds == CONFIGURED


def test_each_bound_gets_one_free_death_so_a_streak_of_five_halves_twice() -> None:
    failed = after_failure(CONFIGURED, 1000, 100 << 20, "heap")  # an exception halves at once
    assert (failed.max_changes, failed.max_bytes) == (500, 50 << 20)
    died = recover_in_flight(with_in_flight(failed, changes=500, bytes_=50 << 20))
    assert (died.max_changes, died.max_bytes, died.failures) == (500, 50 << 20, 2)  # the halved bound's free death
    bounds = CONFIGURED
    sizes = []
    for _ in range(5):  # five deaths in a row, each batch holding all its bounds allow
        bounds = recover_in_flight(with_in_flight(bounds, changes=bounds.max_changes, bytes_=bounds.max_bytes))
        sizes.append(bounds.max_changes)
    assert sizes == [500_000, 250_000, 250_000, 125_000, 125_000] and bounds.failures == 5
    # an OOM-killed batch still ends at one transaction: two deaths per halving
    for _ in range(2 * 17):  # 125,000 halved 17 times
        bounds = recover_in_flight(with_in_flight(bounds, changes=bounds.max_changes, bytes_=bounds.max_bytes))
    assert bounds.max_changes == 1


def test_stored_bounds_never_exceed_the_configured_ones_and_bad_values_fall_back() -> None:
    lower = BatchBounds(max_changes=1000, max_bytes=1 << 20)
    assert BatchBounds.from_json(CONFIGURED.to_json(), lower) == lower
    garbage = {"max_changes": "many", "max_bytes": -3, "failures": None, "reason": 7, "in_flight": []}
    assert BatchBounds.from_json(garbage, CONFIGURED) == CONFIGURED


def test_a_failed_batch_that_held_no_change_keeps_its_bounds() -> None:
    configured = BatchBounds(max_changes=1000, max_bytes=1 << 20)
    failed = after_failure(configured, 0, 0, "a window's staged rows were deleted")
    assert (failed.max_changes, failed.max_bytes, failed.failures) == (1000, 1 << 20, 1)
    assert failed.reason == "a window's staged rows were deleted"
