"""How a batch merges the collections' change streams (``stream.Merge``, pure: streams as lists of events with the
post-batch resume token a real server gives, no server)."""

from __future__ import annotations

from typing import Any

from bson.timestamp import Timestamp

from cdc_assets.sources.mongodb import stream as stream_module
from cdc_assets.sources.mongodb.catalog import CapturedCollection
from cdc_assets.sources.mongodb.stream import Merge, _rows
from cdc_assets.sources.mongodb.watermark import position_of

ITEMS = CapturedCollection("shop", "items")
OTHER = CapturedCollection("shop", "other")
TABLES = {ITEMS.qualified_name: ITEMS, OTHER.qualified_name: OTHER}


def at(inc: int) -> int:
    return position_of(Timestamp(10, inc))


class ListCursor:
    """A change stream over a list of events; ``progress``: where its post-batch resume token stands once the list
    is read (None: the test server, which gives none)."""

    def __init__(self, incs: list[int], progress: int | None = None) -> None:
        self.events = [
            {"_id": {"_data": f"{10:08x}{i:08x}"}, "clusterTime": Timestamp(10, i), "operationType": "insert",
             "fullDocument": {"_id": i}}
            for i in incs
        ]  # fmt: skip
        self.read = 0
        self.progress = progress

    def try_next(self) -> dict[str, Any] | None:
        if self.read == len(self.events):
            return None
        self.read += 1
        return self.events[self.read - 1]

    @property
    def resume_token(self) -> dict[str, str] | None:
        if self.read < len(self.events) or self.progress is None:
            return self.events[self.read - 1]["_id"] if self.read else None
        return {"_data": f"{10:08x}{self.progress:08x}"}


def test_streams_are_merged_by_position_and_read_no_further_than_needed() -> None:
    items, other = ListCursor([1, 3, 4, 8, 9]), ListCursor([2, 3, 5, 9])
    cursors = {ITEMS.qualified_name: items, OTHER.qualified_name: other}
    merge = Merge(cursors, TABLES, at(1), at(8), cluster_time=False)
    order = [(e.position, e.table.collection) for e in merge]
    assert order == [
        (at(1), "items"), (at(2), "other"), (at(3), "items"), (at(3), "other"), (at(4), "items"), (at(5), "other"),
        (at(8), "items"),
    ]  # fmt: skip
    assert merge.reached == at(8) and merge.waiting() == 2  # the events at 9 were read and left

    items, other = ListCursor(list(range(1, 100, 2))), ListCursor(list(range(2, 100, 2)))
    cursors = {ITEMS.qualified_name: items, OTHER.qualified_name: other}
    merge = Merge(cursors, TABLES, at(1), at(99), cluster_time=False)
    batch = _rows(merge, lambda: merge.reached, 10, 10**9)  # a cut after ten events
    assert batch.cut and batch.changes == 10 and batch.applied == at(10)
    assert items.read + other.read <= 13  # ten taken, the one ending the group, and one head per stream


def test_a_real_servers_stream_that_lags_lowers_the_end_below_every_later_event(monkeypatch) -> None:
    """``other`` returns its events up to 4 and its post-batch token stays at 5, short of the bound 9: after
    ``REACH_SECONDS`` the batch ends at 5; ``items``' events after 5 are not taken (they come again next batch)."""
    monkeypatch.setattr(stream_module, "REACH_SECONDS", 0.2)
    items, other = ListCursor([1, 6, 7], progress=9), ListCursor([2, 4], progress=5)
    cursors = {ITEMS.qualified_name: items, OTHER.qualified_name: other}
    merge = Merge(cursors, TABLES, at(1), at(9), cluster_time=True)
    assert [e.position for e in merge] == [at(1), at(2), at(4)]
    assert merge.reached == at(5)


def test_a_real_servers_stream_past_the_bound_needs_no_wait() -> None:
    items, other = ListCursor([1, 6], progress=9), ListCursor([], progress=12)
    cursors = {ITEMS.qualified_name: items, OTHER.qualified_name: other}
    merge = Merge(cursors, TABLES, at(1), at(9), cluster_time=True)
    assert [e.position for e in merge] == [at(1), at(6)] and merge.reached == at(9)
