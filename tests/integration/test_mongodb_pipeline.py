"""The MongoDB source through the generic pipeline (``CdcPipeline`` over ``MongoDialect``): the MongoDB test server
(mongo-java-server, ``mongo_server``), real Spark and Delta.

- Every chunk of a collection with mixed ``_id`` types (ints, longs, doubles, strings, ObjectIds, dates, binary,
  subdocuments) is snapshotted while a writer thread inserts, updates (``$set``, ``$unset``, ``$inc``, ``$push``,
  ``$pull``), replaces, deletes and re-inserts deleted ids; runs are killed at the pipeline's fault points (an
  exception no ``except Exception`` catches, as in ``tests/test_pipeline.py``) and run again; a batch killed after
  its lake commit is re-run from the offset recorded before it. After catch-up the mirror holds exactly the
  collection (canonical extended JSON per ``_id``), no event is twice in the changelog, and a pymongo command
  listener on every client of the pipeline (the driver's and the Spark tasks') saw no write command.
- An idle collection's chunk is reconciled by a batch that reads no event (no write to the source at all); then
  ``updateLookup`` documents newer than their event or gone (updated then deleted, deleted and inserted again) are
  applied in one batch and the mirror is exact; the consistency check matches, and finds a document changed in the
  mirror behind the stream's back.
- The same comparison fails with a broken settled rule (every event settled): a document deleted after the read
  comes back.
- Bad input: an unreachable server, a missing collection, an unparsable resume token, a timestamp in the future, a
  collection dropped while streaming: each a clear message; the drop moves no offset and applies nothing.
- Startup modes: ``latest`` and ``timestamp`` start where they say, a timestamp before the oplog's first entry or in
  the future is refused naming the window; ``snapshot`` reconciles its chunks and streams no further.
- History lost (a recorded offset before the oplog's first entry, as after a truncation): the batch stops naming
  the window and moves nothing, or with ``on_history_lost: resnapshot`` restarts and every chunk is read again, a
  window read before the restart never applied; the mirror ends exact.
- The Dagster glue: definitions, a batch's offset, ``change_offset`` refused or moved back (the acknowledged position
  follows); the planner in ``latest`` mode and after lost history; the stream sensor in ``snapshot`` mode.
- The gated variant runs the main, the startup and the history-lost scenarios against a real replica set
  (``$CDC_TEST_MONGODB_URI``).
"""

from __future__ import annotations

import datetime as dt
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pymongo
import pytest
from bson.binary import Binary
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp
from delta.tables import DeltaTable
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig, SourceConfig, parse_config
from cdc_assets.dialect import OffsetError
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.layout import SourceLake
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.source import PermanentBatchError, SourceError
from cdc_assets.sources.mongodb import history
from cdc_assets.sources.mongodb.bson_order import canonical_json, from_canonical_json
from cdc_assets.sources.mongodb.catalog import CapturedCollection, id_key
from cdc_assets.sources.mongodb.client import CommandAudit, is_write, read_audit
from cdc_assets.sources.mongodb.dialect import MongoDialect, MongoWindow
from cdc_assets.sources.mongodb.watermark import MongoSettledRule, position_of
from resources.cdc import CdcResource
from tests.integration.mongo_support import start_mongo_test_server
from tests.pipeline_support import KILLS, FaultPoints, Killed, Stream


def source_config(
    uri: str, lake_root: Path | str, database: str, chunk_size: int, max_changes: int = 500, timeout_ms: int = 3000,
    **extra: Any,
) -> tuple[CdcConfig, SourceConfig]:  # fmt: skip
    raw = {
        "lake_root": str(lake_root),
        "sources": [{
            "name": "docs", "kind": "mongodb",
            "connection": {"uri": "${CDC_TEST_URI}", "server_selection_timeout_ms": timeout_ms,
                           "connect_timeout_ms": timeout_ms},
            "include": [f"{database}.*"], "mongodb": {"databases": [database]}, "chunk_size": chunk_size,
            "stream": {"max_changes": max_changes}, **extra,
        }],
    }  # fmt: skip
    config = parse_config(raw, Path.cwd(), {"CDC_TEST_URI": uri})  # lake_root: an absolute path or a URI
    return config, config.source("docs")


ID_KINDS = [
    lambda i: i,
    lambda i: Int64(10**12 + i),
    lambda i: i + 0.5,
    lambda i: f"s{i:06d}",
    lambda i: ObjectId(f"{i:024x}"),
    lambda i: dt.datetime(2001, 1, 1) + dt.timedelta(minutes=i),
    lambda i: Binary(i.to_bytes(4, "big"), 0),
    lambda i: {"k": i, "t": "sub"},
    lambda i: -i - 1,
]


def mixed_id(i: int) -> Any:
    """The ``i``-th of distinct ``_id``s of many BSON types (numbers distinct as MongoDB compares them)."""
    return ID_KINDS[i % len(ID_KINDS)](i)


class Writer:
    """Random writes to one collection: inserts of new ids, updates with ``$set``/``$unset``/``$inc``/``$push``/
    ``$pull``, replaces, deletes and re-inserts of deleted ids (of every type)."""

    def __init__(self, collection: pymongo.collection.Collection, ids: list[Any], seed: int) -> None:
        self.collection = collection
        self.rng = random.Random(seed)
        self.live = list(ids)
        self.deleted: list[Any] = []
        self.next = 100_000
        self.writes = 0

    def write(self) -> None:
        rng, collection = self.rng, self.collection
        kind = rng.random()
        if kind < 0.1 or not self.live:
            new = mixed_id(self.next + rng.randrange(len(ID_KINDS)))
            self.next += len(ID_KINDS)
            collection.insert_one({"_id": new, "v": 0, "tags": []})
            self.live.append(new)
        elif kind < 0.55:
            key = rng.choice(self.live)
            update = rng.choice([
                {"$set": {"v": rng.randint(0, 999), f"f{rng.randint(0, 3)}": rng.random()}},
                {"$unset": {"v": ""}},
                {"$inc": {"n": rng.choice([1, Int64(2), 0.5])}},
                {"$push": {"tags": rng.choice(["a", "b", 3])}},
                {"$pull": {"tags": "a"}},
                {"$set": {"nested.deep": {"when": dt.datetime(2020, 1, 1), "bin": Binary(b"\x01\x02", 0)}}},
            ])  # fmt: skip
            collection.update_one({"_id": key}, update)
        elif kind < 0.7:
            key = rng.choice(self.live)
            collection.replace_one({"_id": key}, {"replaced": rng.randint(0, 10**6), "long": Int64(7)})
        elif kind < 0.85:
            key = self.live.pop(rng.randrange(len(self.live)))
            collection.delete_one({"_id": key})
            self.deleted.append(key)
        elif self.deleted:
            key = self.deleted.pop(0)
            collection.insert_one({"_id": key, "again": True, "v": 1.0})
            self.live.append(key)
        self.writes += 1


class BackgroundWriter:
    def __init__(self, writer: Writer, pause: float = 0.05) -> None:
        self.writer, self.pause = writer, pause
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                self.writer.write()
                time.sleep(self.pause)
        except BaseException as error:  # reported by stop()
            self.error = error

    def __enter__(self) -> BackgroundWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        if self.error is not None:
            raise self.error


def assert_exact(spark, pipeline: CdcPipeline, collection: pymongo.collection.Collection) -> None:
    table = pipeline.tables[CapturedCollection(collection.database.name, collection.name).qualified_name]
    # two documents a reply: the test server does not cap replies at 16 MB, and a few large documents pass its 48 MB
    expected = {id_key(d["_id"]): canonical_json(d) for d in collection.find(batch_size=2)}
    mirror = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).mirror)
    assert mirror.where(F.col("_cdc_unknown").isNotNull()).count() == 0
    actual = {r["_id_key"]: r["document"] for r in mirror.select("_id_key", "document").collect()}
    missing = sorted(set(expected) - set(actual))[:3]
    extra = sorted(set(actual) - set(expected))[:3]
    different = [(expected[k], actual[k]) for k in sorted(set(expected) & set(actual)) if expected[k] != actual[k]][:3]
    assert not (missing or extra or different), (table.qualified_name, missing, extra, different)
    ids = {r["_id_key"]: r["_id"] for r in mirror.select("_id_key", "_id").collect()}
    assert all(id_key(from_canonical_json(text)) == key for key, text in ids.items())
    changelog_path = pipeline.lake.table(table.qualified_name).changelog
    if LakePath(changelog_path).exists():  # no event yet: no changelog
        changelog = spark.read.format("delta").load(changelog_path)
        assert changelog.groupBy("_cdc_position", "_cdc_seq").count().where("count > 1").count() == 0


def run_main_scenario(spark, uri: str, database: str, tmp_path: Path, faults: FaultPoints) -> None:
    with pymongo.MongoClient(uri) as client:
        items = client[database]["items"]
        ids = [mixed_id(i) for i in range(200)]
        items.insert_many([{"_id": i, "v": n, "tags": ["a"], "long": Int64(n)} for n, i in enumerate(ids)])
        audit = tmp_path / "commands.log"
        config, source = source_config(uri, tmp_path / "lake", database, chunk_size=50, max_changes=400)
        dialect = MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc", listeners=[CommandAudit(str(audit))])
        pipeline = CdcPipeline(config, source, dialect)
        table = pipeline.prepare()[CapturedCollection(database, "items").qualified_name]
        plan = pipeline.plan(table)
        assert len(plan.chunks) >= 4  # sampled boundaries: several chunks over the mixed types
        writer = Writer(items, ids, seed=5)
        stream = Stream(pipeline, spark)
        kills = iter(KILLS)
        with BackgroundWriter(writer):
            for start in range(0, len(plan.chunks), 2):
                window = list(range(start, min(start + 2, len(plan.chunks))))
                kill = next(kills, None)
                if kill is not None:
                    faults.armed.add(kill)
                try:
                    pipeline.snapshot(spark, table, window, f"s{start}")
                except Killed:
                    pipeline.snapshot(spark, table, window, f"s{start}-rerun")  # the run is retried
                stream.batch()
            for kill in kills:  # the kills no snapshot window took: fired by the next batches
                faults.armed.add(kill)
                while kill in faults.armed:
                    stream.batch()
        assert set(faults.fired) == set(KILLS), faults.fired
        # re-inserts of deleted ids (of every type), then catch up
        for key in writer.deleted[:20]:
            items.insert_one({"_id": key, "back": True})
        stream.batch(acknowledge=False)  # recorded, killed before it was acknowledged
        stream.catch_up()
        assert writer.writes > 30
        assert_exact(spark, pipeline, items)
        windows = spark.read.format("delta").load(pipeline.lake.windows)
        assert windows.where("event = 'reconciled' and chunk >= 0").select("chunk").distinct().count() == len(
            plan.chunks
        )
        commands = read_audit(audit)
        assert "find" in commands and "aggregate" in commands  # the listener saw the reads and the streams
        assert any(line.split()[0] != str(os.getpid()) for line in audit.read_text().splitlines())  # and the tasks'
        assert not [c for c in commands if is_write(c)], sorted({c for c in commands if is_write(c)})
        dialect.close()


def test_mongodb_collection_mirrored_exactly_under_writes_and_kills(
    spark, mongo_server: str, database_name: str, tmp_path: Path, faults: FaultPoints
) -> None:
    run_main_scenario(spark, mongo_server, database_name, tmp_path, faults)


def test_an_idle_collections_chunk_is_reconciled_without_any_write(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    with pymongo.MongoClient(mongo_server) as client:
        notes = client[database_name]["notes"]
        notes.insert_many([{"_id": f"n{i}", "text": f"note {i}"} for i in range(40)])
        config, source = source_config(mongo_server, tmp_path / "lake", database_name, chunk_size=1000)
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[CapturedCollection(database_name, "notes").qualified_name]
        report = pipeline.snapshot(spark, table, [0], "idle")
        assert report.rows == 40
        assert pipeline.pending_work() == "a chunk window can close"  # nothing waits in the stream, but the window
        batch = pipeline.stream_batch(spark, None, "only")
        assert batch.changes == 0 and [r["chunk"] for r in batch.reconciled] == [0] and batch.waiting_windows == 0
        pipeline.acknowledge(batch.offset)
        assert pipeline.pending_work() is None
        assert_exact(spark, pipeline, notes)

        # updateLookup: looked up when read, so newer than its event (n1's first update carries x = 2) or gone
        # (n2 updated, then deleted: no row for the update; n3 updated, deleted and inserted again: the update carries
        # the new document); applied in one batch, the mirror still ends exact
        notes.update_one({"_id": "n1"}, {"$set": {"x": 1}})
        notes.update_one({"_id": "n1"}, {"$set": {"x": 2}, "$unset": {"text": ""}})
        notes.update_one({"_id": "n2"}, {"$inc": {"x": 1}})
        notes.delete_one({"_id": "n2"})
        notes.update_one({"_id": "n3"}, {"$push": {"tags": "a"}})
        notes.delete_one({"_id": "n3"})
        notes.insert_one({"_id": "n3", "again": True})
        notes.replace_one({"_id": "n4"}, {"replaced": Int64(4)})
        assert pipeline.pending_work() == "change events wait after the recorded position"
        batch = pipeline.stream_batch(spark, batch.offset, "lookups")
        assert batch.changes == 8
        pipeline.acknowledge(batch.offset)
        assert pipeline.pending_work() is None
        assert_exact(spark, pipeline, notes)
        changelog = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).changelog)
        ordered = F.sort_array(F.collect_list(F.struct("_cdc_position", "_cdc_seq", "_cdc_op")))
        per_id = changelog.groupBy(F.coalesce("after._id", "before._id").alias("_id")).agg(ordered.alias("ops"))
        ops = {r["_id"]: "".join(op["_cdc_op"] for op in r["ops"]) for r in per_id.collect()}
        assert ops == {'"n1"': "uu", '"n2"': "d", '"n3"': "udc", '"n4"': "u"}

        # the consistency check (count and checksum of canonical documents on both sides): a match, then a document
        # changed in the mirror behind the stream's back is found and named
        (check,) = pipeline.check_chunks(spark, table, [0], wait_seconds=60)
        assert check.conclusive and check.matches and check.source_rows == 39, check
        mirror = DeltaTable.forPath(spark, pipeline.lake.table(table.qualified_name).mirror)
        mirror.update(F.col("_id") == '"n5"', {"document": F.lit('{"_id":"n5","text":"tampered"}')})
        (check,) = pipeline.check_chunks(spark, table, [0], wait_seconds=60)
        assert check.conclusive and not check.matches, check
        difference = check.first_difference or ""
        assert "tampered" in difference and "n5" in difference and "differing columns: document" in difference, check


def test_a_backlog_of_large_documents_streams_through_in_byte_bounded_batches(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    """Seven events of a 7 MB document and new 7 MB documents wait in the stream: one change-stream batch of them is
    larger than the test server's 48 MB message size (it does not cap batches at 16 MB; the stream stalled for good
    on "Message length ... is larger than server max message size"). They are read in smaller change-stream batches,
    and ``max_batch_bytes`` (18 MB) cuts the pipeline's batches between documents: every batch but the last stops
    early, no change is lost or applied twice, and the mirror ends exact. A snapshot of the chunk then reads the
    seven documents again (a reply of 49 MB at first) and the mirror stays exact."""
    with pymongo.MongoClient(mongo_server) as client:
        blobs = client[database_name]["blobs"]
        blobs.insert_one({"_id": "big", "v": -1, "payload": "x" * 7_000_000})
        config, source = source_config(
            mongo_server, tmp_path / "lake", database_name, chunk_size=1000, max_changes=10_000,
            stream={"max_changes": 10_000, "max_batch_bytes": 18_000_000},
        )  # fmt: skip
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[CapturedCollection(database_name, "blobs").qualified_name]
        pipeline.snapshot(spark, table, [0], "initial")
        for i in range(6):
            blobs.update_one({"_id": "big"}, {"$set": {"v": i}})
            blobs.insert_one({"_id": i, "payload": chr(ord("a") + i) * 7_000_000})
        stream = Stream(pipeline, spark)
        reports = []
        while not reports or reports[-1].changes or reports[-1].waiting_windows:
            report = stream.batch()
            assert report is not None
            reports.append(report)
            assert len(reports) < 20, reports
        assert sum(r.changes for r in reports) == 12
        assert max(r.bytes for r in reports) <= 18_000_000  # cut between documents (two of 7 MB a batch)
        assert len([r for r in reports if r.changes]) >= 6  # 12 events of 7 MB in batches of at most 2
        assert_exact(spark, pipeline, blobs)
        # the chunk read again: seven documents of 7 MB in one reply were too large for the test server as well
        assert pipeline.snapshot(spark, table, [0], "again").rows == 7
        stream.catch_up()
        assert_exact(spark, pipeline, blobs)


def test_a_broken_settled_rule_is_caught(
    spark, mongo_server: str, database_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document deleted after the read, before the high watermark: the right rule drops its staged row (the delete
    is after the low watermark); a rule that calls every event settled upserts it after the stream applied the
    delete, and the deleted document is back: the comparison of the main scenario fails."""
    with pymongo.MongoClient(mongo_server) as client:
        items = client[database_name]["items"]
        items.insert_many([{"_id": mixed_id(i), "v": i} for i in range(30)])
        config, source = source_config(mongo_server, tmp_path / "lake", database_name, chunk_size=1000)
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[CapturedCollection(database_name, "items").qualified_name]
        monkeypatch.setattr(MongoSettledRule, "unsettled", lambda self: F.lit(False))
        monkeypatch.setattr(MongoSettledRule, "since_window", lambda self: F.lit(False))
        high_watermark = MongoWindow.high_watermark

        def delete_then_high_watermark(window: MongoWindow) -> int:
            items.delete_one({"_id": mixed_id(5)})  # after every read finished
            return high_watermark(window)

        monkeypatch.setattr(MongoWindow, "high_watermark", delete_then_high_watermark)
        pipeline.snapshot(spark, table, [0], "only")
        Stream(pipeline, spark).catch_up()
        mirror = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).mirror)
        assert mirror.where(F.col("_id_key") == id_key(mixed_id(5))).count() == 1  # resurrected
        with pytest.raises(AssertionError, match=r"items"):
            assert_exact(spark, pipeline, items)


def test_bad_input_gives_clear_messages(spark, mongo_server: str, database_name: str, tmp_path: Path) -> None:
    # unreachable: a closed port, a short timeout; the credentials of the connection string never appear
    config, source = source_config(
        "mongodb://reader:t0psecret@127.0.0.1:9/?directConnection=true", tmp_path / "a", database_name, 10,
        timeout_ms=300,
    )  # fmt: skip
    with pytest.raises(SourceError, match=r"MongoDB at mongodb://\*\*\*@127\.0\.0\.1:9/.*failed") as info:
        MongoDialect(source, tmp_path / "a").discover()
    assert "t0psecret" not in str(info.value) and "reader" not in str(info.value)

    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["items"].insert_many([{"_id": i} for i in range(5)])
        # a collection named under tables that does not exist
        config, source = source_config(mongo_server, tmp_path / "b", database_name, 10,
                                       tables=[f"{database_name}.missing"])  # fmt: skip
        with pytest.raises(SourceError, match=rf"collection {database_name}\.missing \(under tables\) does not exist"):
            MongoDialect(source, tmp_path / "b").discover()

        config, source = source_config(mongo_server, tmp_path / "lake", database_name, 10)
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        pipeline.prepare()
        with pytest.raises(OffsetError, match=r"resume_token: not a resume token .*'zz'"):
            pipeline.validate_offset({"resume_token": "zz"})
        future = int(time.time()) + 3600
        with pytest.raises(OffsetError, match=rf"timestamp: '{future}:1' is cluster time {future}:1, in the future"):
            pipeline.validate_offset({"timestamp": f"{future}:1"})
        with pytest.raises(OffsetError, match=r"exactly one of resume_token .* or timestamp"):
            pipeline.validate_offset({"lsn": "0/1"})
        with client[database_name]["items"].watch(start_at_operation_time=Timestamp(1, 1)) as events:
            event = events.next()
        assert pipeline.validate_offset({"resume_token": event["_id"]["_data"]})["sec"] == event["clusterTime"].time

        # dropped while streaming: stops naming it, nothing applied, the offset does not move
        stream = Stream(pipeline, spark)
        client[database_name]["items"].insert_one({"_id": 50})
        assert stream.batch().changes == 1
        recorded = dict(stream.recorded or {})
        client[database_name]["items"].insert_one({"_id": 99})
        client[database_name]["items"].drop()
        with pytest.raises(PermanentBatchError, match=rf"collection {database_name}\.items .*offset did not move"):
            stream.batch()
        assert stream.recorded == recorded
        mirror = pipeline.lake.table(f"{database_name}.items").mirror
        assert spark.read.format("delta").load(mirror).where("_id_key = '" + id_key(99) + "'").count() == 0


def test_on_a_real_replica_set(spark, real_mongodb: str, tmp_path: Path, faults: FaultPoints) -> None:
    """Gated (``$CDC_TEST_MONGODB_URI``): the main, the startup and the history-lost scenarios against a real replica
    set or ``mongos`` (there, the recorded offset 1:0 is refused by the server itself, error 286, where the source's
    user may not read ``local.oplog.rs``; the window's start is then found by change-stream probes), and change
    events larger than 16 MB, and pre-images as before images."""
    names = [f"cdc_{uuid.uuid4().hex[:10]}" for _ in range(5)]
    for folder in ("main", "startup", "lost", "large", "pre-images"):
        (tmp_path / folder).mkdir()
    try:
        run_main_scenario(spark, real_mongodb, names[0], tmp_path / "main", faults)
        run_startup_scenario(spark, real_mongodb, names[1], tmp_path / "startup", test_server=False)
        run_history_lost_scenario(spark, real_mongodb, names[2], tmp_path / "lost")
        run_large_event_scenario(spark, real_mongodb, names[3], tmp_path / "large")
        run_pre_image_scenario(spark, real_mongodb, names[4], tmp_path / "pre-images", test_server=False)
    finally:
        with pymongo.MongoClient(real_mongodb) as client:
            for name in names:
                client.drop_database(name)


def test_chunk_planning_survives_the_test_servers_failing_sample(mongo_server: str, database_name: str) -> None:
    """The test server's ``$sample`` fails now and then ("Comparison method violates its general contract!": 2 of 60
    calls over mixed ``_id`` types when measured), which made planning fail at random; sixty plans in a row succeed
    (without the retry all sixty pass about one time in six) and each has the chunks it should."""
    from cdc_assets.sources.mongodb.snapshot import plan_chunks

    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["mixed"].insert_many([{"_id": mixed_id(i)} for i in range(200)])
        table = CapturedCollection(database_name, "mixed")
        plans = [plan_chunks(client, table, 50) for _ in range(60)]
    assert all(3 <= len(plan.chunks) <= 4 for plan in plans), [len(p.chunks) for p in plans]


def test_discovery_by_patterns_and_names(mongo_server: str, database_name: str, tmp_path: Path) -> None:
    """No Spark: which collections a source captures, and where its stream starts (stored once)."""
    with pymongo.MongoClient(mongo_server) as client:
        for name in ("orders", "order_lines", "tmp_scratch", "audit"):
            client[database_name][name].insert_one({"_id": 1})
        _, source = source_config(
            mongo_server, tmp_path, database_name, 10, include=[f"{database_name}.order*", f"{database_name}.tmp_*"],
            exclude=[f"{database_name}.tmp_*"], tables=[f"{database_name}.audit"],
        )  # fmt: skip
        dialect = MongoDialect(source, tmp_path / "control")
        tables, skipped = dialect.discover()
        assert [t.collection for t in tables] == ["audit", "order_lines", "orders"] and not skipped
        assert all(t.key_columns == ("_id_key",) for t in tables)
        start = dialect.stream_start()
        client[database_name]["orders"].insert_one({"_id": 2})
        assert MongoDialect(source, tmp_path / "control").stream_start() == start  # first writer wins
        assert dialect.current_position() > start
        dialect.close()


def test_the_dagster_glue_runs_a_mongodb_source(
    spark, mongo_server: str, database_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same Dagster definitions as for PostgreSQL: a chunk-partitioned asset per collection (its real name in
    ``mongodb_collection``), the stream asset recording a batch's offset with MongoDB's fields, and the
    ``change_offset`` job validated by the MongoDB dialect (a timestamp in the future or before the oplog window
    refused naming the field, nothing moved; one back inside the window recorded, the acknowledged position following
    it back, the events after it read again and nothing appended twice)."""
    from dagster import DagsterInstance, materialize

    from cdc_assets.assets import recorded_offset, stream_asset_key, table_asset_key
    from cdc_assets.build import build_definitions

    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["orders"].insert_many([{"_id": i, "n": i} for i in range(5)])
    monkeypatch.setenv("CDC_TEST_URI", mongo_server)
    path = tmp_path / "cdc.yaml"
    path.write_text(
        f"lake_root: {tmp_path / 'lake'}\n"
        "sources:\n"
        "  - name: docs\n    kind: mongodb\n    connection: {uri: '${CDC_TEST_URI}'}\n"
        f"    include: ['{database_name}.*']\n    mongodb: {{databases: [{database_name}]}}\n"
    )
    defs = build_definitions(path)
    table_key = table_asset_key("docs", f"{database_name}.orders")
    assets = {key: asset for asset in defs.assets for key in asset.keys}
    assert {table_key, stream_asset_key("docs")} <= set(assets)
    assert assets[table_key].metadata_by_key[table_key]["mongodb_collection"] == f"{database_name}.orders"
    instance = DagsterInstance.ephemeral()
    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["orders"].insert_many([{"_id": 98, "n": 98}, {"_id": 99, "n": 99}])
    result = materialize([assets[stream_asset_key("docs")]], resources=defs.resources, instance=instance)
    assert result.success
    offset = recorded_offset(instance, "docs")
    assert offset is not None and {"sec", "ord", "resume_token"} <= set(offset)
    job = defs.get_job_def("docs_change_offset")
    refused = job.execute_in_process(
        run_config={"ops": {"docs_record_offset": {"config": {
            "timestamp": "4102444800", "changed_by": "test", "reason": "the future"}}}},
        resources=defs.resources, instance=instance, raise_on_error=False,
    )  # fmt: skip
    assert not refused.success
    assert "timestamp" in str(refused.all_events) and "in the future" in str(refused.all_events)
    assert recorded_offset(instance, "docs") == offset  # nothing moved

    # back inside the oplog window: recorded, and the lake's acknowledged position follows it backwards (as it
    # follows every recorded offset, PostgreSQL's too: CdcPipeline.acknowledge), so the events after it wait again
    lake = SourceLake(tmp_path / "lake", "docs")
    pipeline = CdcResource(config_path=str(path)).pipeline("docs")
    assert lake.acknowledged() == pipeline.position(offset) and pipeline.pending_work() is None
    with pymongo.MongoClient(mongo_server) as client:
        second = cluster_times(client[database_name]["orders"])[5]  # the insert of 98
    moved = job.execute_in_process(
        run_config={"ops": {"docs_record_offset": {"config": {
            "timestamp": f"{second.time}:{second.inc}", "changed_by": "test", "reason": "replay"}}}},
        resources=defs.resources, instance=instance,
    )  # fmt: skip
    assert moved.success
    back = recorded_offset(instance, "docs")
    assert back is not None and (back["sec"], back["ord"]) == (second.time, second.inc)
    assert lake.acknowledged() == pipeline.position(back) < pipeline.position(offset)
    assert pipeline.pending_work() == "change events wait after the recorded position"
    replay = materialize([assets[stream_asset_key("docs")]], resources=defs.resources, instance=instance)
    assert replay.success
    assert lake.acknowledged() == pipeline.position(recorded_offset(instance, "docs")) == pipeline.position(offset)
    changelog = spark.read.format("delta").load(lake.table(f"{database_name}.orders").changelog)
    assert changelog.count() == 2 and pipeline.pending_work() is None  # the replay appended nothing twice
    first = first_oplog_entry(mongo_server)
    before = job.execute_in_process(
        run_config={"ops": {"docs_record_offset": {"config": {
            "timestamp": f"{first.time - 1}", "changed_by": "test", "reason": "too far"}}}},
        resources=defs.resources, instance=instance, raise_on_error=False,
    )  # fmt: skip
    assert not before.success and "before the oplog window" in str(before.all_events)
    assert lake.acknowledged() == pipeline.position(offset)


def test_the_planner_and_the_stream_sensor_follow_the_startup_mode_and_lost_history(
    mongo_server: str, database_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``latest``: the planner adds the chunk partitions and requests no snapshot, saying why; a table marked to be
    read again (lost history) gets every chunk requested once, whatever the mode. ``snapshot``: the stream sensor
    requests a run only when a staged window can close."""
    from dagster import DagsterInstance, build_sensor_context

    from cdc_assets.assets import chunk_partitions
    from cdc_assets.build import build_definitions

    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["orders"].insert_many([{"_id": i} for i in range(25)])
    monkeypatch.setenv("CDC_TEST_URI", mongo_server)
    name = f"{database_name}.orders"

    def definitions(mode: str):
        path = tmp_path / f"{mode}.yaml"
        path.write_text(
            f"lake_root: {tmp_path / mode}\n"
            "sources:\n"
            "  - name: docs\n    kind: mongodb\n    connection: {uri: '${CDC_TEST_URI}'}\n"
            f"    include: ['{database_name}.*']\n    mongodb: {{databases: [{database_name}]}}\n"
            f"    chunk_size: 10\n    startup_mode: {mode}\n"
        )
        return build_definitions(path), SourceLake(tmp_path / mode, "docs")

    defs, lake = definitions("latest")
    planner = next(s for s in defs.sensors if s.name == "docs_planner_sensor")
    instance = DagsterInstance.ephemeral()

    def tick(sensor, cursor: str | None = None):
        with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs, cursor=cursor) as c:
            return sensor.evaluate_tick(c)

    first = tick(planner)
    keys = [key for request in first.dynamic_partitions_requests for key in request.partition_keys]
    assert len(keys) >= 2 and first.run_requests == []
    instance.add_dynamic_partitions(chunk_partitions("docs", name).name, keys)
    quiet = tick(planner, first.cursor)
    assert quiet.run_requests == [] and "startup_mode is 'latest': no snapshot is requested" in quiet.skip_message
    lake.mark_resnapshot(name, 12345 << 32, "history lost: the stream restarted at 12345:0")
    lost = tick(planner, quiet.cursor)
    kind = f"resnapshot@{12345 << 32}:{name}:"
    assert lost.run_requests and all(r.run_key.startswith(kind) for r in lost.run_requests)
    requested = {(r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
                 for r in lost.run_requests}  # fmt: skip
    assert min(s for s, _ in requested) == keys[0] and max(e for _, e in requested) == keys[-1]
    assert all("history lost" in r.tags["cdc/reason"] for r in lost.run_requests)
    assert tick(planner, lost.cursor).run_requests == []  # requested once per marker

    defs, lake = definitions("snapshot")
    stream_sensor = next(s for s in defs.sensors if s.name == "docs_stream_sensor")
    idle = tick(stream_sensor)
    assert idle.run_requests == [] and "no staged chunk waits for the stream" in idle.skip_message
    lake.mark_waiting(name, 0, 1)  # a staged window whose high watermark the source has passed
    due = tick(stream_sensor)
    [request] = due.run_requests
    assert request.tags["cdc/reason"].startswith("startup_mode is 'snapshot': a chunk window can close")
    assert due.asset_events == []  # no lag is recorded in this mode


def cluster_times(collection: pymongo.collection.Collection) -> list[Timestamp]:
    """The cluster times of the collection's change events so far, in order (read from the oplog's first entry:
    a real server refuses an older start)."""
    start = collection.database.client.local["oplog.rs"].find_one({}, sort=[("$natural", 1)])["ts"]
    with collection.watch(start_at_operation_time=start) as events:
        return [event["clusterTime"] for event in iter(events.try_next, None)]


def first_oplog_entry(uri: str) -> Timestamp:
    """The first entry of the oplog (the tests' users may read ``local``; the source's need not)."""
    with pymongo.MongoClient(uri) as client:
        return client.local["oplog.rs"].find_one({}, sort=[("ts", 1)])["ts"]


def mirror_documents(spark, pipeline: CdcPipeline, name: str) -> dict[str, str]:
    mirror = spark.read.format("delta").load(pipeline.lake.table(name).mirror)
    return {r["_id"]: r["document"] for r in mirror.select("_id", "document").collect()}


def test_startup_modes_latest_and_timestamp(spark, mongo_server: str, database_name: str, tmp_path: Path) -> None:
    run_startup_scenario(spark, mongo_server, database_name, tmp_path, test_server=True)


def run_startup_scenario(spark, mongo_server: str, database_name: str, tmp_path: Path, test_server: bool) -> None:
    """``latest``: the stream starts at the position of the first discovery (older documents are not read);
    ``timestamp``: it starts just after the given cluster time; a timestamp before the oplog's first entry (the test
    server's oplog is never truncated and readable as ``local.oplog.rs``) or in the future is refused naming the
    setting and the window, and no start is stored."""
    with pymongo.MongoClient(mongo_server) as client:
        notes = client[database_name]["notes"]
        notes.insert_many([{"_id": f"n{i}", "v": i} for i in range(5)])
        config, source = source_config(mongo_server, tmp_path / "latest", database_name, 1000, startup_mode="latest")
        latest = CdcPipeline(config, source, MongoDialect(source, tmp_path / "latest" / "docs" / "_cdc"))
        latest.prepare()
        notes.insert_one({"_id": "n5", "v": 5})
        stream = Stream(latest, spark)
        assert stream.batch().changes == 1
        assert set(mirror_documents(spark, latest, f"{database_name}.notes")) == {'"n5"'}
        assert latest.pending_work() is None

        n2 = cluster_times(notes)[2]  # the insert of n2
        config, source = source_config(
            mongo_server, tmp_path / "ts", database_name, 1000, startup_mode="timestamp",
            startup_timestamp=f"{n2.time}:{n2.inc}",
        )  # fmt: skip
        since = CdcPipeline(config, source, MongoDialect(source, tmp_path / "ts" / "docs" / "_cdc"))
        assert since.pending_work() == "change events wait after the recorded position"
        Stream(since, spark).catch_up()
        assert set(mirror_documents(spark, since, f"{database_name}.notes")) == {'"n3"', '"n4"', '"n5"'}

        first = first_oplog_entry(mongo_server)
        before = f"{first.time - 1}:7"
        window = "allowed: a cluster time from "  # a real server's user may not read local: found by probes
        if test_server:
            window = rf"its first entry is {first.time}:{first.inc}, read from local\.oplog\.rs.*{window}"
            window += rf"{first.time}:{first.inc - 1} to "
        for given, refusal in (
            (before, rf"startup_timestamp: '{before}' is cluster time {before}, before the oplog window: .*{window}"),
            ("4102444800", r"startup_timestamp: '4102444800' is cluster time 4102444800:0, in the future"),
        ):  # fmt: skip
            lake = tmp_path / f"refused-{given.replace(':', '-')}"
            config, source = source_config(
                mongo_server, lake, database_name, 1000, startup_mode="timestamp", startup_timestamp=given
            )
            with pytest.raises(SourceError, match=rf"source 'docs' \(startup_mode: timestamp\): {refusal}"):
                CdcPipeline(config, source, MongoDialect(source, lake / "docs" / "_cdc")).prepare()
            assert not (lake / "docs" / "_cdc" / "mongodb_stream_start.json").exists()


def test_snapshot_mode_reconciles_its_chunks_and_streams_no_further(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    """``snapshot``: a batch goes only as far as the staged windows' high watermarks (``until``), so the mirror is the
    collection as of the snapshot, and later writes are never streamed; no event makes a batch due, a window does."""
    with pymongo.MongoClient(mongo_server) as client:
        items = client[database_name]["items"]
        items.insert_many([{"_id": i, "v": 0} for i in range(30)])
        config, source = source_config(mongo_server, tmp_path / "lake", database_name, 1000, startup_mode="snapshot")
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[f"{database_name}.items"]
        assert pipeline.streams_only_for_windows
        items.update_one({"_id": 1}, {"$set": {"v": 1}})  # streamed: before the window's high watermark
        pipeline.snapshot(spark, table, [0], "snap")
        expected = {canonical_json(d["_id"]): canonical_json(d) for d in items.find()}
        items.update_one({"_id": 2}, {"$set": {"v": 2}})  # after the snapshot: never streamed
        items.insert_one({"_id": 99})
        assert pipeline.pending_work() == "a chunk window can close"
        stream = Stream(pipeline, spark)
        report = stream.batch()
        assert [r["chunk"] for r in report.reconciled] == [0] and report.changes == 1
        assert mirror_documents(spark, pipeline, table.qualified_name) == expected
        assert pipeline.pending_work() is None  # events wait, but nothing is streamed in this mode
        assert stream.batch().changes == 0
        assert mirror_documents(spark, pipeline, table.qualified_name) == expected
        pipeline.snapshot(spark, table, [0], "again")  # a partition materialized again: read and reconciled
        stream.batch()
        assert_exact(spark, pipeline, items)


def test_the_oplog_window_of_the_test_server(mongo_server: str, database_name: str) -> None:
    """No Spark: the window's start is the first entry of ``local.oplog.rs``; the change-stream probe the source falls
    back to where ``local`` cannot be read accepts any start on the test server (its oplog is never truncated), so
    there only the window check refuses a start before it."""
    with pymongo.MongoClient(mongo_server) as client:
        client[database_name]["items"].insert_one({"_id": 1})
        first = position_of(client.local["oplog.rs"].find_one({}, sort=[("ts", 1)])["ts"])
        table = CapturedCollection(database_name, "items")
        window = history.read_window(client, table, first + 5, natural_order=False)
        assert (window.first, window.earliest, window.current, window.how) == (first, first - 1, first + 5,
                                                                               "local.oplog.rs")  # fmt: skip
        assert window.reaches(first - 1) and not window.reaches(first - 2)
        assert history.probe_start(client, table, (1 << 32) | 1) and history.probe_start(client, table, first + 5)


def test_a_stream_on_the_demos_file_backed_test_server_finds_its_oldest_oplog_entry(spark, tmp_path: Path) -> None:
    """The demo's test server keeps its data in an H2 file, whose oplog's natural order is its ``_id`` order, not the
    order of its entries: read by ``$natural``, the oplog's "first" entry was any entry, and every stream batch whose
    recorded position was before it stopped "history lost" (the demo's MongoDB stream runs failed 4 times in a row).
    On a server without cluster time (the test server) the first entry is the one with the smallest ``ts``."""
    server = start_mongo_test_server(tmp_path / "server", data_file=tmp_path / "shop.mv.db")
    try:
        with pymongo.MongoClient(server.uri) as client:
            items = client["shop"]["items"]
            for i in range(200):  # one oplog entry each, stored under random keys (H2's natural order)
                items.insert_one({"_id": i, "v": i})
            oplog = client.local["oplog.rs"]
            oldest = position_of(oplog.find_one({}, sort=[("ts", 1)])["ts"])
            # The naturally first entry is the one with the smallest random key: the oldest one with chance 1/n. Once
            # another entry is first, the oldest never is again; so write more until it is not (1 in 10,200 runs
            # would fail here, not at random further on).
            for more in range(50):
                natural = position_of(oplog.find_one({}, sort=[("$natural", 1)])["ts"])
                if natural != oldest:
                    break
                items.insert_many([{"_id": 1000 + 200 * more + i, "v": 1000} for i in range(200)], ordered=True)
            assert natural != oldest  # the backend this test is about (else it proves nothing)
            config, source = source_config(server.uri, tmp_path / "lake", "shop", 1000)
            pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
            table = pipeline.prepare()["shop.items"]
            assert pipeline.dialect.oplog_window().first == oldest
            pipeline.snapshot(spark, table, [0], "snap")
            items.update_many({"v": {"$lt": 50}}, {"$set": {"w": "after the snapshot"}})
            items.delete_many({"v": {"$gte": 190}})
            Stream(pipeline, spark).catch_up()
            assert_exact(spark, pipeline, items)
    finally:
        server.stop()


def run_large_event_scenario(spark, uri: str, database: str, tmp_path: Path) -> None:
    """Updates of a document near 16 MB (``updateLookup``: the event holds the whole document and the update's
    fields, over 16 MB): on a server that splits large events (7.0, 6.0.9+) they stream through and the mirror is
    exact; on one that cannot, the batch stops naming the collection and the way on, and the offset stays."""
    near_limit = 15 * 2**20 + 900 * 2**10
    with pymongo.MongoClient(uri) as client:
        items = client[database]["items"]
        items.insert_many([{"_id": 1, "blob": "a" * near_limit}, {"_id": 2, "v": 0}])
        config, source = source_config(uri, tmp_path / "lake", database, chunk_size=20)
        dialect = MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc")
        pipeline = CdcPipeline(config, source, dialect)
        table = pipeline.prepare()[f"{database}.items"]
        pipeline.snapshot(spark, table, [c.index for c in pipeline.plan(table).chunks], "first")
        stream = Stream(pipeline, spark)
        stream.catch_up()
        items.update_one({"_id": 1}, {"$set": {"blob": "b" * near_limit}})  # event: two copies, ~31.8 MB
        items.update_one({"_id": 2}, {"$set": {"v": 1}})
        if dialect.capabilities.split_large_events:
            stream.catch_up()
            assert_exact(spark, pipeline, items)
        else:
            recorded = dict(stream.recorded or {})
            with pytest.raises(PermanentBatchError, match=rf"collection {database}\.items: a change event is larger"):
                stream.batch()
            assert stream.recorded == recorded


def run_pre_image_scenario(spark, uri: str, database: str, tmp_path: Path, test_server: bool) -> None:
    """``full_document_before_change``: on a real server (6.0+, the collection created with
    ``changeStreamPreAndPostImages``) with ``required``, the changelog's before images of an update, a replace and a
    delete are the documents as they were; on the test server, which ignores the option and keeps no pre-images,
    ``whenAvailable`` streams as without it (an update's before image empty, a delete's the key alone). The mirror
    is exact either way."""
    with pymongo.MongoClient(uri) as client:
        if not test_server:
            client[database].create_collection("items", changeStreamPreAndPostImages={"enabled": True})
        items = client[database]["items"]
        items.insert_many([{"_id": 1, "x": 1}, {"_id": 2, "x": 2}, {"_id": 3, "x": 3}])
        mode = "whenAvailable" if test_server else "required"
        options = {"databases": [database], "full_document_before_change": mode}
        config, source = source_config(uri, tmp_path / "lake", database, chunk_size=20, mongodb=options)
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[f"{database}.items"]
        pipeline.snapshot(spark, table, [c.index for c in pipeline.plan(table).chunks], "first")
        stream = Stream(pipeline, spark)
        stream.catch_up()
        items.update_one({"_id": 1}, {"$set": {"x": 10}})
        items.replace_one({"_id": 2}, {"y": 20})
        items.delete_one({"_id": 3})
        stream.catch_up()
        assert_exact(spark, pipeline, items)
    changelog = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).changelog)
    befores = {
        r["key"]: (r["_cdc_op"], r["document"], r["_cdc_before_key_only"])
        for r in changelog.where("_cdc_op in ('u', 'd')")
        .select(F.coalesce("after._id", "before._id").alias("key"), "_cdc_op", "_cdc_before_key_only",
                "before.document")
        .collect()
    }  # fmt: skip
    one, two, three = (canonical_json(i) for i in (1, 2, 3))
    if test_server:
        assert befores == {one: ("u", None, False), two: ("u", None, False), three: ("d", None, True)}, befores
    else:
        assert befores == {
            one: ("u", canonical_json({"_id": 1, "x": 1}), False),
            two: ("u", canonical_json({"_id": 2, "x": 2}), False),
            three: ("d", canonical_json({"_id": 3, "x": 3}), False),
        }, befores


def test_pre_images_asked_for_on_a_server_without_them_stream_as_without(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    run_pre_image_scenario(spark, mongo_server, database_name, tmp_path, test_server=True)


def run_history_lost_scenario(spark, uri: str, database: str, tmp_path: Path) -> None:
    """A recorded offset the oplog no longer covers (cluster time 1:0: before every oplog, so a real server refuses
    it too), after changes the stream never read. ``on_history_lost: fail``: the batch stops naming the collection,
    the position, the window and the ways on; nothing moves. ``resnapshot``: the batch restarts the stream at the
    current position and records that every chunk is read again; a window read before the restart is not applied
    (its read can predate a lost change); after every chunk is read again the mirror is exact and the marks are gone."""
    lost = {"sec": 1, "ord": 0, "resume_token": None}
    with pymongo.MongoClient(uri) as client:
        items = client[database]["items"]
        items.insert_many([{"_id": mixed_id(i), "v": "v0"} for i in range(60)])
        config, source = source_config(uri, tmp_path / "lake", database, chunk_size=20)
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[f"{database}.items"]
        plan = pipeline.plan(table)
        assert len(plan.chunks) >= 2
        pipeline.snapshot(spark, table, [c.index for c in plan.chunks], "first")
        stream = Stream(pipeline, spark)
        stream.catch_up()
        assert_exact(spark, pipeline, items)
        x, y = mixed_id(7), mixed_id(8)
        key = id_key(x)
        chunk = next(
            c.index for c in plan.chunks if (c.lo is None or c.lo[0] <= key) and (c.hi is None or key < c.hi[0])
        )
        items.update_one({"_id": x}, {"$set": {"v": "v1"}})
        pipeline.snapshot(spark, table, [chunk], "before-the-loss")  # reads v1; stays open
        items.update_one({"_id": x}, {"$set": {"v": "v2"}})  # the lost changes
        items.delete_one({"_id": y})
        items.insert_one({"_id": "z", "v": "new"})
        before = mirror_documents(spark, pipeline, table.qualified_name)
        acknowledged = pipeline.lake.acknowledged()

        stream.recorded = lost
        with pytest.raises(PermanentBatchError) as info:
            stream.batch()
        message = str(info.value)
        for part in ("history lost", f"{database}.items", "recorded position 1:0", "the oplog window",
                     "offset did not move", "change_offset", "on_history_lost: resnapshot"):  # fmt: skip
            assert part in message, (part, message)
        assert stream.recorded == lost and pipeline.lake.acknowledged() == acknowledged
        assert mirror_documents(spark, pipeline, table.qualified_name) == before
        with pytest.raises(OffsetError, match=r"timestamp: '1:0' is cluster time 1:0, before the oplog window"):
            pipeline.validate_offset({"timestamp": "1:0"})

        config, source = source_config(uri, tmp_path / "lake", database, 20, mongodb={
            "databases": [database], "on_history_lost": "resnapshot"})  # fmt: skip
        pipeline = CdcPipeline(config, source, MongoDialect(source, tmp_path / "lake" / "docs" / "_cdc"))
        table = pipeline.prepare()[f"{database}.items"]
        stream = Stream(pipeline, spark)
        stream.recorded = lost
        report = stream.batch()
        assert report.changes == 0 and report.resnapshot and "every chunk" in report.resnapshot
        marker = pipeline.lake.resnapshot_markers()[table.qualified_name]
        assert marker.position == pipeline.position(report.offset) > pipeline.position(lost)
        # the window read before the restart (x = v1) was closable but is not applied
        assert report.reconciled == [] and mirror_documents(spark, pipeline, table.qualified_name) == before
        (check,) = pipeline.check_chunks(spark, table, [chunk], wait_seconds=5)
        assert not check.conclusive and "read again" in (check.reason or ""), check
        items.update_one({"_id": mixed_id(9)}, {"$set": {"v": "after"}})  # after the restart: streamed
        items.delete_one({"_id": mixed_id(10)})
        pipeline.snapshot(spark, table, [c.index for c in plan.chunks], "again")
        items.insert_one({"_id": "late", "v": "streamed"})
        stream.catch_up()
        assert_exact(spark, pipeline, items)
        assert pipeline.lake.resnapshot_markers() == {}


def test_history_lost_stops_or_reads_every_chunk_again(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    run_history_lost_scenario(spark, mongo_server, database_name, tmp_path)


def test_a_collection_created_while_a_stream_run_is_in_flight_loses_no_change(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    """A run resolves its collections when it starts, and opens a change stream per captured collection. A collection
    created later and matching the include pattern: another process (the snapshot run) captures it and reads its
    chunk, then documents change, and the run in flight streams on. Its batch lists the collections after reading,
    resolves them again and reads the batch again with the new collection's stream (before, those events were left
    behind and the next run started after them: the mirror kept the snapshot's documents)."""
    lake = tmp_path / "lake"
    with pymongo.MongoClient(mongo_server) as client:
        database = client[database_name]
        database["first"].insert_many([{"_id": i, "v": i} for i in range(20)])
        config, source = source_config(mongo_server, lake, database_name, chunk_size=1000)

        def pipeline() -> CdcPipeline:
            return CdcPipeline(config, source, MongoDialect(source, lake / "docs" / "_cdc"))

        in_flight = pipeline()
        first = in_flight.prepare()[f"{database_name}.first"]
        in_flight.snapshot(spark, first, [0], "first")
        report = in_flight.stream_batch(spark, None, "b0")
        in_flight.acknowledge(report.offset)
        fresh = database["fresh"]
        fresh.insert_many([{"_id": f"f{i}", "v": i} for i in range(30)])
        snapshotting = pipeline()
        snapshotting.snapshot(spark, snapshotting.prepare()[f"{database_name}.fresh"], [0], "fresh")
        fresh.update_many({"v": {"$lt": 10}}, {"$set": {"changed": "after its snapshot"}})
        fresh.delete_many({"v": {"$gte": 25}})
        database["first"].update_one({"_id": 1}, {"$set": {"v": "first too"}})
        report = in_flight.stream_batch(spark, report.offset, "b1")
        in_flight.acknowledge(report.offset)
        # the next run (its collections resolved when it starts) finds every change in both mirrors
        next_run = pipeline()
        next_run.prepare()
        offset = report.offset
        for attempt in range(5):
            later = next_run.stream_batch(spark, offset, f"n{attempt}")
            offset = later.offset
            next_run.acknowledge(offset)
            if later.changes == 0 and later.waiting_windows == 0:
                break
        assert_exact(spark, next_run, fresh)
        assert_exact(spark, next_run, database["first"])
        # the run in flight captured the collection from the batch that met it on
        assert report.newly_captured == [f"{database_name}.fresh"], report
        assert sorted(in_flight.tables) == sorted(next_run.tables)
