"""How change events become changelog rows and how a batch is bounded (pure: events as the test server and a real
server give them, no server)."""

from datetime import UTC, datetime

from bson.int64 import Int64
from bson.timestamp import Timestamp

from cdc_assets.sources.mongodb.bson_order import canonical_json, sort_key
from cdc_assets.sources.mongodb.catalog import CapturedCollection, document_row
from cdc_assets.sources.mongodb.stream import Event, _rows
from cdc_assets.sources.mongodb.watermark import position_of

ITEMS = CapturedCollection("shop", "items")
OTHER = CapturedCollection("shop", "other")


def event(table, time, inc, raw, order=0):
    raw = {"clusterTime": Timestamp(time, inc), "_id": {"_data": f"{time:08x}{inc:08x}"}, **raw}
    return Event(table, position_of(Timestamp(time, inc)), raw["_id"]["_data"], raw, order)


def test_document_rows_keep_every_type_apart_and_key_by_bson_order() -> None:
    one, long_one = document_row({"_id": 1, "v": 1}), document_row({"_id": Int64(1), "v": Int64(1)})
    assert one["_id_key"] == long_one["_id_key"] == sort_key(1).hex()  # the same _id for MongoDB
    assert one["document"] != long_one["document"]  # but the values stay apart
    assert one["_id"] == canonical_json(1) and one["document"] == '{"_id":{"$numberInt":"1"},"v":{"$numberInt":"1"}}'
    assert document_row({"_id": "b"})["_id_key"] > document_row({"_id": 10**12})["_id_key"]  # strings after numbers


def test_events_become_rows_and_a_failed_lookup_yields_none() -> None:
    events = [
        event(ITEMS, 10, 1, {"operationType": "insert", "documentKey": {"_id": 1}, "fullDocument": {"_id": 1, "x": 1}}),
        # the test server: documentKey is the update, the looked-up document carries _id
        event(
            ITEMS,
            10,
            2,
            {"operationType": "update", "documentKey": {"$set": {"x": 2}}, "fullDocument": {"_id": 1, "x": 3}},
        ),
        # deleted since: the test server gives the update's delta, a real server null
        event(ITEMS, 10, 3, {"operationType": "update", "documentKey": {"$set": {"x": 3}}, "fullDocument": {"x": 3}}),
        event(ITEMS, 10, 4, {"operationType": "replace", "documentKey": {"_id": 1}, "fullDocument": None}),
        event(ITEMS, 10, 5, {"operationType": "delete", "documentKey": {"_id": 1}, "fullDocument": None}),
        event(OTHER, 10, 6, {"operationType": "drop"}),  # another collection's drop on the test server: no row
    ]
    batch = _rows(events, lambda: position_of(Timestamp(10, 9)), 100, 10**9)
    rows = batch.rows["shop.items"]
    assert [r["_cdc_op"] for r in rows] == ["c", "u", "d"]
    assert rows[1]["after"]["document"] == '{"_id":{"$numberInt":"1"},"x":{"$numberInt":"3"}}'
    assert rows[2]["after"] is None and rows[2]["before"]["document"] is None and rows[2]["_cdc_before_key_only"]
    assert rows[2]["before"]["_id_key"] == sort_key(1).hex()
    assert batch.skipped_lookups == 2 and batch.changes == 5 and not batch.cut
    assert batch.applied == position_of(Timestamp(10, 9))  # the end, not the last event: nothing else came before it
    assert rows[0]["_cdc_ts"] == datetime.fromtimestamp(10, UTC)


def test_pre_images_fill_the_before_image_where_the_server_gives_them() -> None:
    before = {"_id": 1, "x": 1}
    events = [
        event(ITEMS, 11, 1, {"operationType": "update", "documentKey": {"_id": 1}, "fullDocument": {"_id": 1, "x": 2},
                             "fullDocumentBeforeChange": before}),
        event(ITEMS, 11, 2, {"operationType": "replace", "documentKey": {"_id": 1}, "fullDocument": {"_id": 1, "y": 1},
                             "fullDocumentBeforeChange": {"_id": 1, "x": 2}}),
        event(ITEMS, 11, 3, {"operationType": "delete", "documentKey": {"_id": 1},
                             "fullDocumentBeforeChange": {"_id": 1, "y": 1}}),
        # whenAvailable and none kept (pre-images not enabled, or expired): as without the option
        event(ITEMS, 11, 4, {"operationType": "update", "documentKey": {"_id": 2}, "fullDocument": {"_id": 2},
                             "fullDocumentBeforeChange": None}),
        event(ITEMS, 11, 5, {"operationType": "delete", "documentKey": {"_id": 2}, "fullDocumentBeforeChange": None}),
    ]  # fmt: skip
    rows = _rows(events, lambda: position_of(Timestamp(11, 9)), 100, 10**9).rows["shop.items"]
    assert [r["_cdc_op"] for r in rows] == ["u", "u", "d", "u", "d"]
    assert rows[0]["before"] == document_row(before) and rows[0]["after"] == document_row({"_id": 1, "x": 2})
    assert rows[1]["before"]["document"] == '{"_id":{"$numberInt":"1"},"x":{"$numberInt":"2"}}'
    assert rows[2]["before"]["document"] == '{"_id":{"$numberInt":"1"},"y":{"$numberInt":"1"}}'
    assert not rows[2]["_cdc_before_key_only"] and rows[2]["after"] is None
    assert rows[3]["before"] is None
    assert rows[4]["_cdc_before_key_only"] and rows[4]["before"]["document"] is None


def test_a_batch_is_cut_between_cluster_times_never_inside_one() -> None:
    insert = {"operationType": "insert"}
    events = [event(ITEMS, 10, 1, {**insert, "fullDocument": {"_id": 1}}, 1)]
    # one transaction: three events at one cluster time, over two collections
    events += [event(ITEMS, 10, 2, {**insert, "fullDocument": {"_id": i}}, i) for i in (2, 3)]
    events += [event(OTHER, 10, 2, {**insert, "fullDocument": {"_id": 9}}, 4)]
    events += [event(ITEMS, 10, 3, {**insert, "fullDocument": {"_id": 5}}, 5)]
    batch = _rows(events, lambda: position_of(Timestamp(10, 3)), 2, 10**9)
    assert batch.cut and batch.applied == position_of(Timestamp(10, 1)) and batch.changes == 1 and batch.waiting == 4
    batch = _rows(events, lambda: position_of(Timestamp(10, 3)), 4, 10**9)
    assert batch.cut and batch.applied == position_of(Timestamp(10, 2)) and batch.changes == 4  # the group is whole
    assert [(r["_cdc_position"], r["_cdc_seq"]) for r in batch.rows["shop.items"]] == [
        (position_of(Timestamp(10, 1)), 0), (position_of(Timestamp(10, 2)), 0), (position_of(Timestamp(10, 2)), 1)
    ]  # fmt: skip
    assert batch.rows["shop.other"][0]["_cdc_seq"] == 2
    single = _rows(events, lambda: position_of(Timestamp(10, 3)), 1, 1)  # a group larger than the bounds is read whole
    assert single.changes == 1 and single.cut
