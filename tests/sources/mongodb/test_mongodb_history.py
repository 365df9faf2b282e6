"""The oplog window and lost history of the MongoDB source (pure): which starts the oplog still covers, which server
errors mean history lost, the probe search for the window's start, and what the messages name."""

import pytest
from bson.timestamp import Timestamp
from pymongo.errors import AutoReconnect, OperationFailure

from cdc_assets.sources.mongodb.catalog import CapturedCollection
from cdc_assets.sources.mongodb.history import (
    OplogWindow,
    earliest_second,
    gap_before,
    history_lost_message,
    is_history_lost,
    resnapshot_reason,
    unreachable_message,
)
from cdc_assets.sources.mongodb.watermark import position_of

FIRST = position_of(Timestamp(1795735100, 3))
NOW = position_of(Timestamp(1795735200, 7))
KNOWN = OplogWindow(FIRST - 1, NOW, "local.oplog.rs", FIRST)
UNKNOWN = OplogWindow(None, NOW, "the user may not read local.oplog.rs and no collection is captured")
NOT_IN_OPLOG = "as the resume point may no longer be in the oplog."
ORDERS, LINES = CapturedCollection("shop", "orders"), CapturedCollection("shop", "order_lines")


def test_a_start_reaches_the_oplog_when_every_change_after_it_is_still_there() -> None:
    assert KNOWN.reaches(FIRST - 1) is True  # the first entry itself is after it
    assert KNOWN.reaches(NOW) is True
    assert KNOWN.reaches(FIRST - 2) is False  # changes between it and the first entry may be gone
    assert UNKNOWN.reaches(1) is None
    assert not gap_before(FIRST - 1, FIRST) and not gap_before(FIRST + 5, FIRST) and gap_before(FIRST - 2, FIRST)
    assert not gap_before(FIRST - 2, None)  # unknown: the server's own error decides
    assert not gap_before(0, FIRST)  # the test server's start fixed before its first event


def test_the_window_is_described_with_its_bounds() -> None:
    assert KNOWN.describe() == (
        "the oplog window: every change after 1795735100:2 (its first entry is 1795735100:3, read from "
        "local.oplog.rs), up to 1795735200:7 now"
    )
    assert KNOWN.allowed() == "a cluster time from 1795735100:2 to 1795735200:7"
    probed = OplogWindow(position_of(Timestamp(1795735100, 0)), NOW, "change-stream probes")
    assert "every change after 1795735100:0 (found by change-stream probes)" in probed.describe()
    assert "its start is unknown (the user may not read local.oplog.rs" in UNKNOWN.describe()
    assert UNKNOWN.allowed().endswith("at or before 1795735200:7")


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (OperationFailure("Resume of change stream was not possible", code=286), True),
        (OperationFailure("the resume token was not found", code=280), True),
        (OperationFailure(f"Resume of change stream was not possible, {NOT_IN_OPLOG}", code=None), True),
        (OperationFailure("E11000 duplicate key error", code=11000), False),
        (OperationFailure('Unknown error: For input string: "zz" under radix 16', code=None), False),
        (AutoReconnect("connection closed"), False),
        (ValueError("ChangeStreamHistoryLost"), False),
    ],
)
def test_which_server_errors_mean_history_lost(error: BaseException, lost: bool) -> None:
    assert is_history_lost(error) is lost


def test_the_probe_search_finds_the_first_second_the_oplog_covers_in_few_probes() -> None:
    probes: list[int] = []

    def reaches(second: int) -> bool:
        probes.append(second)
        return second >= 1795735100

    assert earliest_second(reaches, 0, 1795735200) == 1795735100
    assert len(probes) <= 33 and 1795735100 in probes
    assert earliest_second(lambda s: True, 0, 99) == 0
    assert earliest_second(lambda s: False, 0, 99) is None  # not even now: no window at all
    assert earliest_second(lambda s: True, 5, 4) is None


def test_the_history_lost_message_names_the_collection_the_position_the_window_and_the_ways_on() -> None:
    recorded = position_of(Timestamp(1795735000, 5))
    message = history_lost_message("docs", [ORDERS, LINES], ORDERS, recorded, KNOWN, "ChangeStreamHistoryLost")
    assert message.startswith("source 'docs': history lost: the change stream of shop.orders cannot go on after the ")
    for part in (
        "recorded position 1795735000:5 (the stream asset's offset sec:ord)",
        "(ChangeStreamHistoryLost)",
        "every change after 1795735100:2 (its first entry is 1795735100:3",
        "Nothing of this batch was applied and the offset did not move",
        "change_offset job (timestamp: a cluster time from 1795735100:2 to 1795735200:7;",
        "re-materialize every chunk partition",
        "mongodb.on_history_lost: resnapshot on source 'docs'",
    ):
        assert part in message, (part, message)
    whole = history_lost_message("docs", [ORDERS, LINES], None, 1, UNKNOWN, "before the first entry")
    assert "the change streams of shop.orders, shop.order_lines cannot go on" in whole
    many = [CapturedCollection("shop", f"c{i}") for i in range(8)]
    assert "shop.c4 and 3 more" in history_lost_message("docs", many, None, 1, UNKNOWN, "x")


def test_the_resnapshot_reason_and_the_refused_start_name_what_happened() -> None:
    reason = resnapshot_reason("docs", [ORDERS], None, FIRST - 9, NOW, KNOWN, "the oplog's first entry is after it")
    assert "on_history_lost is resnapshot: the stream restarted at 1795735200:7" in reason
    assert "every chunk of every captured collection is read again" in reason
    refused = unreachable_message("timestamp", "1700000000", position_of(Timestamp(1700000000, 0)), KNOWN)
    assert refused == (
        "timestamp: '1700000000' is cluster time 1700000000:0, before the oplog window: the oplog no longer holds "
        "every change after it; the oplog window: every change after 1795735100:2 (its first entry is 1795735100:3, "
        "read from local.oplog.rs), up to 1795735200:7 now; allowed: a cluster time from 1795735100:2 to 1795735200:7"
    )
