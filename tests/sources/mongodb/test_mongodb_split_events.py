"""Change events larger than 16 MB (``$changeStreamSplitLargeEvent``, ``client``'s split-event functions, pure: the
fragments as a MongoDB 7.0 server sends them, no server; the test server cannot split, see
``tests/integration/test_mongo_test_server.py``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from cdc_assets.sources.mongodb.client import (
    SPLIT_STAGE,
    assemble_split_event,
    split_event_hint,
    splits_large_events,
    whole_split_event,
)

BIG = "x" * 1000  # stands for the megabytes of a real fragment


def token(n: int) -> dict[str, str]:
    return {"_data": f"8265{n:028x}"}


def fragments() -> list[dict[str, Any]]:
    """An update of a document near 16 MB with updateLookup, cut in three as MongoDB does: the small fields first,
    then the looked-up document, then the update's description; each fragment with a resume token of its own."""
    return [
        {
            "_id": token(1), "splitEvent": {"fragment": 1, "of": 3}, "operationType": "update",
            "clusterTime": Timestamp(1700000000, 4), "wallTime": None, "ns": {"db": "shop", "coll": "sessions"},
            "documentKey": {"_id": 7},
        },
        {"_id": token(2), "splitEvent": {"fragment": 2, "of": 3}, "fullDocument": {"_id": 7, "blob": BIG, "n": 2}},
        {
            "_id": token(3), "splitEvent": {"fragment": 3, "of": 3},
            "updateDescription": {"updatedFields": {"blob": BIG}, "removedFields": [], "truncatedArrays": []},
        },
    ]  # fmt: skip


def test_fragments_are_one_event_with_the_last_fragments_resume_token() -> None:
    event = assemble_split_event(fragments())
    assert event == {
        "_id": token(3),  # resuming after it resumes after the whole event
        "operationType": "update",
        "clusterTime": Timestamp(1700000000, 4),
        "wallTime": None,
        "ns": {"db": "shop", "coll": "sessions"},
        "documentKey": {"_id": 7},
        "fullDocument": {"_id": 7, "blob": BIG, "n": 2},
        "updateDescription": {"updatedFields": {"blob": BIG}, "removedFields": [], "truncatedArrays": []},
    }


def test_the_cursor_reads_the_fragments_after_the_first_and_no_further() -> None:
    first, *rest = fragments()
    after = {"_id": token(4), "operationType": "delete", "clusterTime": Timestamp(1700000001, 1)}
    stream: Iterator[dict[str, Any]] = iter([*rest, after])
    event = whole_split_event(first, lambda: next(stream))
    assert event["_id"] == token(3) and "fullDocument" in event and "updateDescription" in event
    assert next(stream) is after  # the next event is left for the next read


@pytest.mark.parametrize(
    ("keep", "numbers"),
    [([0, 2], "[(1, 3), (3, 3)]"), ([1, 0, 2], "[(2, 3), (1, 3), (3, 3)]"), ([0, 1], "[(1, 3), (2, 3)]")],
)
def test_missing_or_reordered_fragments_are_refused(keep: list[int], numbers: str) -> None:
    cut = fragments()
    with pytest.raises(ValueError, match=re.escape(f"fragments (fragment, of) are {numbers}: expected 1 to 3")):
        assemble_split_event([cut[i] for i in keep])


def test_fragments_that_disagree_on_a_field_are_refused() -> None:
    cut = fragments()
    cut[2]["operationType"] = "replace"
    with pytest.raises(ValueError, match="disagree on its field 'operationType'"):
        assemble_split_event(cut)


@pytest.mark.parametrize(
    ("version", "splits"),
    [
        ([7, 0, 0, 0], True), ([8, 0, 4, 0], True), ([6, 0, 9, 0], True), ([6, 0, 14, 0], True),
        ([6, 0, 8, 0], False), ([6, 1, 0, 0], False), ([6, 3, 2, 0], False), ([5, 0, 30, 0], False),
        ([3, 0, 0], False), ([0], False),
    ],
)  # fmt: skip
def test_which_servers_split_large_events(version: list[int], splits: bool) -> None:
    assert splits_large_events(version) is splits


def test_the_split_stage_is_the_one_mongodb_names() -> None:
    assert SPLIT_STAGE == {"$changeStreamSplitLargeEvent": {}}


def test_an_event_too_large_for_a_server_that_cannot_split_it_names_the_collection_and_the_way_on() -> None:
    message = "BSONObj size: 17825792 (0x1100000) is invalid. Size must be between 0 and 16793600(16MB)"
    error = OperationFailure(message, 10334)
    hint = split_event_hint(error, "shop.sessions")
    assert hint is not None and hint.startswith("collection shop.sessions: a change event is larger than 16 MB")
    assert "MongoDB 6.0.9 or 7.0+" in hint and "its offset stays" in hint
    assert split_event_hint(OperationFailure("not master", 10107), "shop.sessions") is None
