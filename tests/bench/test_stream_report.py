"""The stream bench's report of its warm replay (``bench/stream.py``, step 6): our changelog and merge phases again
on a warm JVM, set beside the run's own phases and the floor's statements."""

from __future__ import annotations

from typing import Any

from bench.common import JvmClock
from bench.stream import summed, warm_lines


def record(replay: dict[str, Any] | None) -> dict[str, Any]:
    ours = {
        "changes": 1_000_000,
        "seconds": 80.0,
        "batches": [
            {"phases": {"read": 6.0, "changelog": 8.0, "merge": 26.0, "reconcile": 1.0},
             "jvm": {"compile_seconds": 25.0, "gc_seconds": 1.0}},
            {"phases": {"read": 6.0, "changelog": 4.0, "merge": 14.0, "reconcile": 0.5},
             "jvm": {"compile_seconds": 10.0, "gc_seconds": 0.5}},
        ],
    }  # fmt: skip
    floor = {"append_seconds": 6.0, "merge_seconds": 20.0,
             "batches": [{"jvm": {"compile_seconds": 3.0, "gc_seconds": 0.25}},
                         {"jvm": {"compile_seconds": 2.0, "gc_seconds": 0.25}}]}  # fmt: skip
    result: dict[str, Any] = {"ours": ours, "floor": floor}
    if replay is not None:
        result["warm_replay"] = replay
    return result


def test_the_lines_set_the_warm_replay_beside_the_run_and_the_floor() -> None:
    replay = {"changelog_seconds": 7.0, "merge_seconds": 21.0,
              "batches": [{"jvm": {"compile_seconds": 1.5, "gc_seconds": 0.5}},
                          {"jvm": {"compile_seconds": 0.5, "gc_seconds": 0.5}}]}  # fmt: skip
    first, jit, ratio = warm_lines(record(replay))
    assert "changelog 7.0 + merge 21.0 = 28.0 s, 1.08x the floor's 26.0 s" in first
    assert "took 12.0 + 40.0 = 52.0 s: 24.0 s more" in first
    assert "35.0 in the run's batches (first batch 25.0), 5.0 in the floor's, 2.0 in the warm replay's" in jit
    assert "collectors' 1.5, 0.5, 1.0" in jit
    # 80 s - 52 + 28 = 56 s: 1M/56 against 1M/26 changes/s
    assert "0.464 (56.0 s; what is left besides them: {'read': 12.0, 'reconcile': 1.5})" in ratio


def test_an_older_record_without_a_replay_gives_no_line() -> None:
    assert warm_lines(record(None)) == []
    assert warm_lines(record({"changelog_seconds": 0.0, "merge_seconds": 0.0, "batches": []})) == []


def test_two_readings_of_the_jvm_clock_give_what_happened_between() -> None:
    spent = JvmClock(12.5, 3.25) - JvmClock(10.0, 3.0)
    assert spent.to_json() == {"compile_seconds": 2.5, "gc_seconds": 0.25}


def test_summed_keeps_the_batches_and_sums_each_named_field() -> None:
    batches = [{"a": 1.0, "b": 2.0}, {"a": 0.5, "b": 1.0}]
    assert summed(batches, "a") == {"batches": batches, "a": 1.5}
