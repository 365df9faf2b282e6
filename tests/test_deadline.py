"""``cdc_assets.deadline``: an answer in time, an error handed on, a silent action given up at the deadline."""

from __future__ import annotations

import threading
import time

import pytest

from cdc_assets.deadline import Asked, NoAnswer, within


def test_an_answer_in_time_is_returned() -> None:
    assert within(5, "source 'a'", lambda: 42) == 42


def test_an_error_of_the_action_is_raised_to_the_caller() -> None:
    def fails() -> None:
        raise ValueError("no such table")

    with pytest.raises(ValueError, match="no such table"):
        within(5, "source 'a'", fails)


def test_a_silent_action_is_given_up_at_the_deadline_and_named() -> None:
    never = threading.Event()
    started = time.monotonic()
    with pytest.raises(NoAnswer, match=r"^source 'hung' did not answer within 0.5 s$") as raised:
        within(0.5, "source 'hung'", never.wait)
    assert 0.4 < time.monotonic() - started < 3
    assert isinstance(raised.value, TimeoutError) and raised.value.what == "source 'hung'"
    never.set()


def test_actions_asked_together_share_one_deadline() -> None:
    release = threading.Event()
    slow = [Asked(f"source {n}", lambda: release.wait(30)) for n in range(3)]
    fast = Asked("source fast", lambda: "figures")
    deadline = time.monotonic() + 0.5
    for asked in slow:
        with pytest.raises(NoAnswer):
            asked.answer(deadline)
    assert time.monotonic() - deadline < 1  # three silent sources cost the deadline once, not three times
    assert fast.answer(deadline) == "figures"
    release.set()
