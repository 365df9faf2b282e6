"""What the MongoDB test server (mongo-java-server 1.47.0, memory backend, oplog on) does with pymongo 4.15.3: the
assumptions the MongoDB source builds on, written as assertions (``docs/mongodb.md`` lists them). A changed server
version that behaves differently fails here first. The gated test at the end runs the ``_id`` order check against a
real replica set (``$CDC_TEST_MONGODB_URI``)."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from pymongo.change_stream import ChangeStream
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import AutoReconnect, BulkWriteError, ConfigurationError, DuplicateKeyError, OperationFailure
from pymongo.read_concern import ReadConcern

from cdc_assets.sources.mongodb.bson_order import canonical_json, sort_key
from tests.integration.mongo_support import start_mongo_test_server

EVENT_FIELDS = {"_id", "operationType", "clusterTime", "documentKey", "fullDocument"}


@pytest.fixture(scope="module")
def client(mongo_server: str) -> Iterator[pymongo.MongoClient]:
    with pymongo.MongoClient(mongo_server) as connected:
        yield connected


@pytest.fixture
def db(client: pymongo.MongoClient, request: pytest.FixtureRequest) -> Iterator[Database]:
    """A database of this test's own (change streams of a collection also see other collections' drops)."""
    name = re.sub(r"\W", "_", request.node.name)[:60]
    client.drop_database(name)
    yield client[name]
    client.drop_database(name)


def next_position(client: pymongo.MongoClient) -> Timestamp:
    """A start point after everything written so far: the oplog's last entry plus one increment (the test server
    keeps its oplog readable in ``local.oplog.rs``)."""
    last = client.local["oplog.rs"].find_one(sort=[("$natural", -1)])
    return Timestamp(1, 0) if last is None else Timestamp(last["ts"].time, last["ts"].inc + 1)


def drain(stream: ChangeStream, count: int, attempts: int = 50) -> list[dict[str, Any]]:
    """The next ``count`` events of ``stream`` (fewer when it has no more within ``attempts`` polls)."""
    events: list[dict[str, Any]] = []
    for _ in range(attempts):
        if len(events) == count:
            break
        event = stream.try_next()
        if event is not None:
            events.append(event)
    return events


def test_crud(db: Database) -> None:
    items = db.items
    items.insert_many([{"_id": i, "v": i} for i in range(5)])
    items.update_one({"_id": 1}, {"$set": {"s": "x"}, "$inc": {"v": 10}})
    items.update_one({"_id": 2}, {"$unset": {"v": ""}})
    items.update_one({"_id": 3}, {"$push": {"tags": "a"}})
    items.replace_one({"_id": 4}, {"r": True})
    items.delete_one({"_id": 0})
    assert list(items.find().sort("_id", 1)) == [
        {"_id": 1, "v": 11, "s": "x"},
        {"_id": 2},
        {"_id": 3, "v": 3, "tags": ["a"]},
        {"_id": 4, "r": True},
    ]
    assert items.count_documents({}) == 4
    with pytest.raises(DuplicateKeyError):
        items.insert_one({"_id": 1})


def test_values_round_trip_except_binary_subtype_128(db: Database) -> None:
    document = every_type_document()
    db.values.insert_one(document)
    assert canonical_json(db.values.find_one()) == canonical_json(document)
    db.values.insert_one({"_id": 2, "b": Binary(b"\x00\x01", 128)})
    assert canonical_json(db.values.find_one({"_id": 2})["b"]) == canonical_json(b"\x00\x01")  # subtype 0, not 128


@pytest.mark.parametrize("subtype", [1, 2, 5, 6, 7, 8, 9, 200])
def test_other_binary_subtypes_drop_the_connection(db: Database, subtype: int) -> None:
    with pytest.raises(AutoReconnect, match="connection closed"):
        db.binary.insert_one({"_id": 1, "b": Binary(b"\x05\x06\x07", subtype)})
    assert db.binary.count_documents({}) == 0  # the server itself lives on


def test_a_15_mb_document_round_trips_also_through_a_change_stream(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    big = "x" * (15 * 1024 * 1024) + "end"
    db.big.insert_one({"_id": 1, "s": big})
    assert db.big.find_one()["s"] == big
    with db.big.watch(start_at_operation_time=start) as stream:
        (event,) = drain(stream, 1)
    assert event["fullDocument"]["s"] == big


def every_type_document() -> dict[str, Any]:
    """One document with a value of each type the source maps (binary subtypes 0, 3 and 4 included)."""
    return {
        "_id": ObjectId("0123456789abcdef01234567"),
        "i": 1,
        "l": Int64(1),
        "d": 1.0,
        "dec": Decimal128("1.0000000000000000000000000000001"),
        "t": dt.datetime(1960, 1, 1, 0, 0, 0, 1000),
        "ts": Timestamp(5, 6),
        "re": Regex("^a", "i"),
        "u": Binary(uuid.UUID(int=9).bytes, 4),
        "old_uuid": Binary(uuid.UUID(int=9).bytes, 3),
        "b": b"\x00\x01",
        "nested": {"z": [1, Int64(2), {"a": None}], "a": MinKey(), "m": MaxKey()},
    }


@pytest.mark.parametrize("backend", ["memory", "h2"])
def test_a_refused_insert_reaches_no_change_stream(backend: str, client: pymongo.MongoClient, tmp_path: Path) -> None:
    """The launcher's correction of mongo-java-server 1.47.0 (``cdclake.StoredInsertsOplog``): the library logs
    every document of an insert command in its oplog, the refused ones included, so a change stream saw a second
    insert of an ``_id`` that E11000 refused, and the documents an ordered ``insertMany`` never tried after it. Only
    stored documents reach the oplog now, on either backend (the demo's is H2), and a document of every type still
    does (the correction compares the stored document with the inserted one)."""
    server = None
    if backend == "h2":
        server = start_mongo_test_server(tmp_path / "logs", data_file=tmp_path / "store.mv.db")
        client = pymongo.MongoClient(server.uri)
    try:
        items = client["refused_inserts"].items
        items.drop()
        start = next_position(client)
        items.insert_one({"_id": "k", "v": 1})
        with pytest.raises(DuplicateKeyError):
            items.insert_one({"_id": "k", "v": 2})
        with pytest.raises(BulkWriteError):
            items.insert_many([{"_id": "m", "v": 1}, {"_id": "k", "v": 3}, {"_id": "n", "v": 1}])  # ordered
        items.insert_one(every_type_document())
        items.update_one({"_id": "k"}, {"$set": {"v": 4}}, upsert=True)
        items.update_one({"_id": "u"}, {"$set": {"v": 5}}, upsert=True)  # an upsert's insert is logged as one
        stored = sorted(str(document["_id"]) for document in items.find())
        assert stored == sorted(["k", "m", "u", str(every_type_document()["_id"])]), stored
        with items.watch(start_at_operation_time=start, full_document="updateLookup") as stream:
            events = drain(stream, 7, attempts=20)
        seen = [(e["operationType"], e["fullDocument"]["_id"]) for e in events]  # an update's documentKey is odd
        assert seen == [
            ("insert", "k"), ("insert", "m"), ("insert", every_type_document()["_id"]), ("update", "k"),
            ("insert", "u"),
        ], seen  # fmt: skip
        assert canonical_json(events[2]["fullDocument"]) == canonical_json(every_type_document())
    finally:
        if server is not None:
            client.close()
            server.stop()


def test_collection_watch_from_an_operation_time(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    items = db.items
    items.insert_one({"_id": 1, "x": 1})
    items.update_one({"_id": 1}, {"$set": {"x": 2}})
    items.update_one({"_id": 1}, {"$inc": {"x": 5}, "$unset": {"y": ""}})
    items.replace_one({"_id": 1}, {"x": 3})
    items.delete_one({"_id": 1})
    with items.watch(start_at_operation_time=start) as stream:
        insert, set_, inc, replace, delete = drain(stream, 6)
    # a replace arrives as an update
    assert [e["operationType"] for e in (insert, set_, inc, replace, delete)] == [
        "insert",
        "update",
        "update",
        "update",
        "delete",
    ]
    for event in (insert, set_, inc, replace, delete):
        assert set(event) == EVENT_FIELDS  # no ns, no updateDescription, no wallTime
        assert isinstance(event["clusterTime"], Timestamp)
        # the resume token is the cluster time in hex: seconds and increment, 8 digits each
        time, inc_ = event["clusterTime"].time, event["clusterTime"].inc
        assert event["_id"] == {"_data": f"{time:08x}{inc_:08x}"}
    times = [e["clusterTime"] for e in (insert, set_, inc, replace, delete)]
    assert times == sorted(times) and len(set(times)) == 5
    assert insert["documentKey"] == {"_id": 1} and insert["fullDocument"] == {"_id": 1, "x": 1}
    # an update's documentKey is the update document; its fullDocument (without updateLookup) is not the document
    # but the argument of the update's last operator
    assert set_["documentKey"] == {"$set": {"x": 2}} and set_["fullDocument"] == {"x": 2}
    assert inc["documentKey"] == {"$inc": {"x": 5}, "$unset": {"y": ""}}
    assert inc["fullDocument"] == {"y": ""}  # the last operator's argument
    # a replace's documentKey is the replacement (with _id), its fullDocument empty
    assert replace["documentKey"] == {"x": 3, "_id": 1} and replace["fullDocument"] == {}
    assert delete["documentKey"] == {"_id": 1} and delete["fullDocument"] is None


def test_update_lookup_gives_the_current_document(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    db.items.insert_one({"_id": 1, "x": 1})
    db.items.update_one({"_id": 1}, {"$set": {"x": 2}})
    db.items.update_one({"_id": 1}, {"$set": {"x": 3}})
    with db.items.watch(start_at_operation_time=start, full_document="updateLookup") as stream:
        _, first_update, second_update = drain(stream, 3)
    # looked up when read, not when written: both updates carry the latest document
    assert first_update["fullDocument"] == second_update["fullDocument"] == {"_id": 1, "x": 3}
    assert first_update["documentKey"] == {"$set": {"x": 2}}


def test_no_pre_images(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    db.items.insert_one({"_id": 1, "x": 1})
    db.items.update_one({"_id": 1}, {"$set": {"x": 2}})
    with db.items.watch(start_at_operation_time=start, full_document_before_change="whenAvailable") as stream:
        events = drain(stream, 2)
    assert [set(e) for e in events] == [EVENT_FIELDS, EVENT_FIELDS]  # accepted, no fullDocumentBeforeChange


def test_watch_without_a_start_point_fails_for_want_of_operation_time(db: Database) -> None:
    with pytest.raises(OperationFailure, match="Expected field 'operationTime' missing from command response"):
        with db.items.watch() as stream:
            stream.try_next()


def test_no_post_batch_resume_token_and_no_operation_time(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    db.items.insert_one({"_id": 1})
    reply = db.command("aggregate", "items", pipeline=[{"$changeStream": {"startAtOperationTime": start}}], cursor={})
    assert set(reply) == {"cursor", "ok"}
    assert set(reply["cursor"]) == {"id", "ns", "firstBatch"}
    assert len(reply["cursor"]["firstBatch"]) == 1
    more = db.command("getMore", reply["cursor"]["id"], collection="items")
    assert set(more["cursor"]) == {"id", "ns", "nextBatch"} and more["cursor"]["nextBatch"] == []


@pytest.mark.parametrize("option", ["resume_after", "start_after"])
def test_resume_from_a_token(db: Database, client: pymongo.MongoClient, option: str) -> None:
    start = next_position(client)
    db.items.insert_many([{"_id": i} for i in range(4)])
    with db.items.watch(start_at_operation_time=start) as stream:
        events = drain(stream, 4)
    with db.items.watch(**{option: events[1]["_id"]}) as stream:
        resumed = drain(stream, 3)
    assert [e["documentKey"] for e in resumed] == [{"_id": 2}, {"_id": 3}]  # strictly after the token


def test_a_start_long_before_the_oplog_is_accepted(db: Database) -> None:
    db.items.insert_one({"_id": 1})
    with db.items.watch(start_at_operation_time=Timestamp(1, 1)) as stream:
        events = drain(stream, 1)
    assert events and events[0]["operationType"] in ("insert", "drop")  # no history-lost error


def test_a_garbled_resume_token_is_an_unknown_error(db: Database) -> None:
    with pytest.raises(OperationFailure, match='Unknown error: For input string: "zz" under radix 16'):
        with db.items.watch(resume_after={"_data": "zz"}) as stream:
            stream.try_next()


def test_database_watch_is_accepted_but_delivers_only_drops(db: Database, client: pymongo.MongoClient) -> None:
    start = next_position(client)
    db.items.insert_one({"_id": 1})
    db.items.update_one({"_id": 1}, {"$set": {"x": 1}})
    db.other.insert_one({"_id": 1})
    db.other.drop()
    with db.watch(start_at_operation_time=start) as stream:
        events = drain(stream, 4)
    assert [e["operationType"] for e in events] == ["drop"]
    assert set(events[0]) == {"_id", "operationType", "clusterTime"}  # no ns: which collection is not said


def test_client_watch_fails(client: pymongo.MongoClient) -> None:
    with pytest.raises(OperationFailure, match="no such command: 'aggregate'"):
        with client.watch(start_at_operation_time=Timestamp(1, 1)) as stream:
            stream.try_next()


def test_a_collection_stream_sees_other_collections_drops_and_no_rename(
    db: Database, client: pymongo.MongoClient
) -> None:
    start = next_position(client)
    db.items.insert_one({"_id": 1})
    db.items.rename("renamed")
    db.renamed.insert_one({"_id": 2})
    db.marker.insert_one({"_id": 1})
    db.marker.drop()
    with db.items.watch(start_at_operation_time=start) as stream:
        events = drain(stream, 3)
    # the rename leaves no event (nor an invalidate); the drop of another collection of the database arrives
    assert [e["operationType"] for e in events] == ["insert", "drop"]
    assert [op["op"] for op in client.local["oplog.rs"].find({"ts": {"$gte": start}})] == ["i", "i", "i", "c"]


def test_sample_answers_distinct_ids_and_fails_now_and_then(db: Database) -> None:
    """``$sample`` gives distinct ids of the collection, but now and then fails with "Comparison method violates its
    general contract!" (the server hands a random order to Java's sort; CI met it on a single call). Chunk planning
    retries exactly that error (``snapshot._sample_ids``); any other error, or failing most calls, fails here."""
    db.items.insert_many([{"_id": i} for i in range(100)])
    samples: list[list[int]] = []
    for _ in range(40):
        try:
            samples.append([d["_id"] for d in db.items.aggregate([{"$sample": {"size": 5}}])])
        except OperationFailure as error:
            assert "general contract" in str(error), error
    assert len(samples) >= 30, f"{40 - len(samples)} of 40 calls failed"
    assert all(len(s) == len(set(s)) == 5 and set(s) <= set(range(100)) for s in samples), samples


def test_min_max_with_hint_ignores_the_bounds(db: Database) -> None:
    db.items.insert_many([{"_id": i} for i in range(100)])
    bounded = db.items.find().min([("_id", 10)]).max([("_id", 20)]).hint([("_id", 1)])
    assert len(list(bounded)) == 100  # a real server returns _id 10..19


def test_read_concern_majority(db: Database) -> None:
    db.items.insert_many([{"_id": i} for i in range(3)])
    majority: Collection = db.items.with_options(read_concern=ReadConcern("majority"))
    assert [d["_id"] for d in majority.find().sort("_id", 1)] == [0, 1, 2]
    assert [d["_id"] for d in majority.aggregate([{"$sort": {"_id": 1}}])] == [0, 1, 2]


def test_coll_stats_works(db: Database) -> None:
    db.items.insert_many([{"_id": i} for i in range(3)])
    stats = db.command("collStats", "items")
    assert stats["count"] == 3 and stats["ns"] == f"{db.name}.items"


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (lambda db: db.command("splitVector", f"{db.name}.items", keyPattern={"_id": 1}), "no such command"),
        (lambda db: list(db.items.aggregate([{"$bucketAuto": {"groupBy": "$_id", "buckets": 2}}])), "'\\$bucketAuto'"),
        (
            lambda db: db.items.watch([{"$changeStreamSplitLargeEvent": {}}], start_at_operation_time=Timestamp(1, 1)),
            "'\\$changeStreamSplitLargeEvent'",
        ),
        (lambda db: db.items.update_one({"_id": 1}, [{"$set": {"x": 1}}]), "ArrayList cannot be cast"),
        (lambda db: db.client.admin.command("hello"), "no such command: 'hello'"),
        (lambda db: db.client.admin.command("replSetGetStatus"), "not running with --replSet"),
    ],
    ids=["splitVector", "bucketAuto", "changeStreamSplitLargeEvent", "pipeline-update", "hello", "replSetGetStatus"],
)
def test_unsupported(db: Database, run: Any, message: str) -> None:
    db.items.insert_one({"_id": 1})
    with pytest.raises(OperationFailure, match=message):
        run(db)


def test_the_source_sends_the_split_stage_only_where_the_server_has_it(client: pymongo.MongoClient) -> None:
    """The test server answers ``buildInfo`` and is no replica set: the source's ``Capabilities`` say it cannot split
    large events, so its streams never carry the stage it refuses (above)."""
    from cdc_assets.sources.mongodb.client import Capabilities, splits_large_events

    version = client.admin.command("buildInfo")["versionArray"]
    assert not splits_large_events(version), version
    assert Capabilities.of(client) == Capabilities(cluster_time=False, split_large_events=False)


def test_no_sessions_hence_no_transactions(db: Database, client: pymongo.MongoClient) -> None:
    with client.start_session() as session:
        session.start_transaction()  # pymongo checks only when the session is first used
        with pytest.raises(ConfigurationError, match="Sessions are not supported by this MongoDB deployment"):
            db.items.insert_one({"_id": 1}, session=session)
    with client.start_session() as session:
        with pytest.raises(ConfigurationError, match="Sessions are not supported by this MongoDB deployment"):
            db.items.find_one({}, session=session)
    assert db.items.count_documents({}) == 0


# ---------------------------------------------------------------------------------------------------------------
# the _id order
# ---------------------------------------------------------------------------------------------------------------

# mixed-type ids on which the test server's order agrees with the documented one (and sort_key)
AGREED_IDS: list[Any] = [
    MinKey(),
    None,
    float("-inf"),
    Int64(-(2**62)),
    -2.5,
    -1,
    Decimal128("-0.5"),
    0,
    1e-300,
    0.5,
    1,
    Int64(2),
    2.5,
    Decimal128("3.25"),
    float(2**53),
    Int64(2**53 + 1),
    1e300,
    float("inf"),
    "",
    "A",
    "Z",
    "a",
    "a\x00b",
    "ab",
    "é",
    "\uffff",
    {},
    {"a": None},
    {"a": 1},
    {"a": 1, "b": None},
    {"aa": 0},
    {"b": 0},
    {"a": "x"},
    {"a": {"b": 1}},
    {"b": {"c": 1}},
    {"a": b"x"},
    {"a": True},
    b"",
    b"\x01",
    b"\xff",
    b"\x00\x00",
    Binary(uuid.UUID(int=1).bytes, 3),
    Binary(uuid.UUID(int=1).bytes, 4),
    ObjectId("000000000000000000000001"),
    ObjectId("ffffffffffffffffffffffff"),
    False,
    True,
    dt.datetime(1900, 1, 1),
    dt.datetime(1969, 12, 31, 23, 59, 59),
    dt.datetime(2020, 1, 1),
    Timestamp(1, 5),
    Timestamp(2, 0),
    Regex("a", "i"),  # one only: the server cannot sort two regular expressions (see below)
    MaxKey(),
]


def server_order(collection: Collection, ids: list[Any]) -> list[str]:
    """``ids`` inserted in reverse order (an order that merely follows insertion does not pass for sorted ``ids``),
    read back sorted by the server: their canonical extended JSON."""
    collection.insert_many([{"_id": value} for value in reversed(ids)])
    return [canonical_json(d["_id"]) for d in collection.find().sort("_id", 1)]


def test_the_servers_id_order_is_sort_keys_order_on_agreed_types(db: Database) -> None:
    expected = [canonical_json(v) for v in sorted(AGREED_IDS, key=sort_key)]
    assert server_order(db.mixed, AGREED_IDS) == expected
    assert expected == [canonical_json(v) for v in AGREED_IDS]  # the list above is written in that order


@pytest.mark.parametrize(
    ("server_first", "documented_first"),
    [
        (float("inf"), float("nan")),  # the server puts NaN after +inf; documented: NaN before every number
        ("\U0001f600", "\uffff"),  # the server compares UTF-16 code units; documented: UTF-8 bytes
    ],
    ids=["nan", "supplementary-character"],
)
def test_where_the_servers_order_differs_from_the_documented_one(
    db: Database, server_first: Any, documented_first: Any
) -> None:
    assert server_order(db.mixed, [server_first, documented_first]) == [
        canonical_json(server_first),
        canonical_json(documented_first),
    ]
    assert sort_key(documented_first) < sort_key(server_first)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a": [1, 9]}, {"a": [1, 2]}),
        ({"a": [1, 2]}, {"a": [1, 9]}),
        ({"a": [1]}, {"a": [1, 2]}),
        ({"a": [1, 2]}, {"a": [1]}),
        ({"a": [1, "x"]}, {"a": [1, 2]}),
    ],
)
def test_the_server_compares_arrays_inside_an_id_by_their_first_element_only(
    db: Database, first: Any, second: Any
) -> None:
    # arrays with equal first elements compare equal: the server returns them in insertion order (first, second)
    assert server_order(db.mixed, [second, first]) == [canonical_json(first), canonical_json(second)]
    assert sort_key(first) != sort_key(second)


def test_the_server_orders_arrays_inside_an_id_with_different_first_elements(db: Database) -> None:
    ids = [{"a": []}, {"a": [0]}, {"a": [1, 5]}, {"a": [2]}, {"a": ["x"]}]
    assert server_order(db.mixed, ids) == [canonical_json(v) for v in sorted(ids, key=sort_key)]


def test_the_server_cannot_sort_two_regular_expression_ids(db: Database) -> None:
    db.mixed.insert_many([{"_id": Regex("a")}, {"_id": Regex("b")}])
    with pytest.raises(
        OperationFailure, match=r"can.t compare class de\.bwaldvogel\.mongo\.bson\.BsonRegularExpression"
    ):
        list(db.mixed.find().sort("_id", 1))


def test_the_server_compares_decimal128_through_a_double(db: Database) -> None:
    db.ids.insert_one({"_id": 1})
    db.ids.insert_one({"_id": Decimal128("0.1")})
    for same_double in (Decimal128("1.0000000000000000000000000000001"), 0.1):
        with pytest.raises(DuplicateKeyError):  # distinct values for MongoDB and for sort_key
            db.ids.insert_one({"_id": same_double})
        assert sort_key(same_double) != sort_key(1) and sort_key(same_double) != sort_key(Decimal128("0.1"))
    for equal in (1.0, Int64(1)):  # equal values: a duplicate, as on MongoDB
        with pytest.raises(DuplicateKeyError):
            db.ids.insert_one({"_id": equal})


def test_a_real_server_orders_ids_like_sort_key(real_mongodb: str) -> None:
    """Gated (``$CDC_TEST_MONGODB_URI``): the documented order, including where the test server differs."""
    ids = [
        *AGREED_IDS,
        float("nan"),
        "\U0001f600",
        {"a": [1]},
        {"a": [1, 2]},
        Decimal128("1.0000000000000000000000000000001"),
        Decimal128("0.1"),
        0.1,
        Binary(b"\x00", 128),
    ]
    with pymongo.MongoClient(real_mongodb) as real:
        name = f"cdc_probe_{uuid.uuid4().hex[:12]}"
        try:
            assert server_order(real[name].mixed, ids) == [canonical_json(v) for v in sorted(ids, key=sort_key)]
        finally:
            real.drop_database(name)
