"""An ad-hoc snapshot of chosen rows on real PostgreSQL, Spark and Delta, on the MongoDB test server, and as the
Dagster job ``<source>_snapshot_rows``.

- PostgreSQL: a table mirrored exactly; mirror rows changed behind the stream's back (matching the filter and not,
  a matching row removed, a row moved to a key the source lacks); the filtered snapshot runs while a writer commits
  updates (rows moving into and out of the filter), deletes and re-inserts; after catch-up the matching rows equal
  the source, the tampered rows the filter does not match are untouched, and the row at a key the source lacks is
  still there (an ad-hoc snapshot never deletes).
- PostgreSQL: injection attempts in the column, the operator and the value: the first two and a value that does not
  cast to its column's type are refused naming the field, with nothing recorded in the window log, nothing staged
  and the slot where it was; a value such as ``x'; drop table items; --`` is a string literal that matches no row.
- MongoDB: the same basic scenario with a query document (``$where`` refused as a field name).
- Dagster: the job runs in process with the real resources: bad config fails before anything is read (the message
  names the table and the column), good config stages the rows and records an observation, and the stream asset
  then reconciles them: the mirror holds exactly the matching rows.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pymongo
import pytest
from dagster import AssetKey, DagsterInstance, materialize
from delta.tables import DeltaTable
from pyspark.sql import functions as F

from cdc_assets.assets import stream_asset_key
from cdc_assets.build import build_definitions
from cdc_assets.engine.row_filter import RowFilterError
from cdc_assets.engine.windows import RECONCILED, ROWS_CHUNK, STAGED
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.staging import ATTEMPT_FOLDER_PREFIX
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.snapshot_rows import snapshot_rows_op_name
from cdc_assets.sources.mongodb.bson_order import canonical_json
from cdc_assets.sources.mongodb.catalog import CapturedCollection
from cdc_assets.sources.mongodb.dialect import MongoDialect
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from cdc_assets.sources.postgres.stream import slot_position
from tests.integration.support import (
    PG_PORT,
    READER_PASSWORD,
    mirror_rows,
    pipeline_config,
    seeded_source,
    source_rows,
)
from tests.integration.test_mongodb_pipeline import source_config as mongo_source_config
from tests.pipeline_support import Stream

DATABASE = "pipe_rows"
ITEMS = "public.items"
# items.qty is id % 17: the filter matches ids with qty 3 or 5 up to 1500
FILTER = [{"column": "qty", "op": "in", "value": [3, 5]}, {"column": "id", "op": "<=", "value": 1500}]
TAMPERED_MATCHING = [3, 20, 37, 5]  # qty 3, 3, 3, 5
REMOVED_MATCHING = 22  # qty 5
TAMPERED_OTHERS = [4, 7, 1587, 1603]  # qty 4, 7, 6; and 5 but id > 1500
MOVED_AWAY = 1598  # qty 0: moved to key -7 with qty 3 in the mirror (a row the source does not have)
GHOST = -7


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    with seeded_source(postgres_server, DATABASE) as (admin, admin_dsn):
        yield admin, admin_dsn, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=500)


def catch_up(pipeline: PostgresPipeline, spark, recorded=None, rounds: int = 10) -> tuple[dict, list[dict]]:
    """Stream batches until nothing waits; the last offset and the rows windows reconciled."""
    rows_windows: list[dict] = []
    for _ in range(rounds):
        report = pipeline.stream_batch(spark, recorded, "test")
        recorded = report.offset
        pipeline.acknowledge(recorded)
        rows_windows += report.rows_windows
        if report.waiting_windows == 0 and report.changes == 0:
            return recorded, rows_windows
    raise AssertionError(f"no catch-up in {rounds} batches")


def staged_attempts(pipeline: CdcPipeline, name: str) -> list[str]:
    folder = Path(pipeline.lake.table(name).staging)
    return sorted(p.name for p in folder.glob(f"{ATTEMPT_FOLDER_PREFIX}rows-*")) if folder.exists() else []


class Writer(threading.Thread):
    """Commits one change at a time to rows with ids 100..1400 (none of the tampered ones) until stopped: updates of
    matching rows, rows moved out of and into the filter, deletes and re-inserts."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.writes = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute("set synchronous_commit = on")
                n = 0
                while not self.stop.is_set():
                    base = 100 + (n * 17) % 1300
                    first = base - base % 17  # qty 0; the ids below keep the qty of their residue
                    again = "insert into items (id, name, qty) values (%s, 'again', 3) on conflict do nothing"
                    statements = [
                        ("update items set name = %s where id = %s", [f"w{n}", first + 3]),  # qty 3
                        ("update items set qty = 4 where id = %s", [first + 5]),  # out of the filter
                        ("update items set qty = 3 where id = %s", [first + 9]),  # into it
                        ("delete from items where id = %s", [first + 22]),  # qty 5
                        (again, [first + 22]),
                    ]
                    for statement, parameters in statements:
                        conn.execute(statement, parameters)
                        self.writes += 1
                    n += 1
        except BaseException as error:  # reported by the test
            self.error = error


def test_a_filtered_snapshot_repairs_only_matching_rows_under_a_concurrent_writer(source, spark) -> None:
    _, admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()[ITEMS]
    pipeline.snapshot(spark, table, list(range(len(pipeline.plan(table).chunks))), "initial")
    recorded, _ = catch_up(pipeline, spark)
    names = [c.name for c in table.columns]
    at = {name: names.index(name) for name in ("id", "name", "qty")}
    mirror_path = pipeline.lake.table(ITEMS).mirror
    assert mirror_rows(spark, mirror_path, table) == source_rows(config.sources[0], table)

    mirror = DeltaTable.forPath(spark, mirror_path)
    mirror.update(F.col("id").isin(TAMPERED_MATCHING + TAMPERED_OTHERS), {"name": F.lit("tampered")})
    mirror.delete(F.col("id") == REMOVED_MATCHING)
    mirror.update(F.col("id") == MOVED_AWAY, {"id": F.lit(GHOST).cast("long"), "qty": F.lit(3)})

    [(requested, row_filter)] = pipeline.rows_requests([(ITEMS, FILTER)])
    assert row_filter is not None and row_filter.describe() == "qty in (3, 5) and id <= 1500"
    writer = Writer(f"{admin_dsn} dbname={DATABASE}")
    writer.start()
    try:
        while writer.writes < 20 and writer.error is None:
            time.sleep(0.01)
        writes_before = writer.writes
        report = pipeline.snapshot_rows(spark, requested, row_filter, "adhoc")
        writes_during = writer.writes - writes_before
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    assert writes_during > 0 and report.rows > 100
    events = [e for e in window_log.read_events(spark, pipeline.lake.windows) if e.window.chunk == ROWS_CHUNK]
    assert [(e.event, e.window.attempt, e.window.rows) for e in events] == [(STAGED, report.attempt, report.rows)]

    _, rows_windows = catch_up(pipeline, spark, recorded)
    assert [(r["table"], r["attempt"]) for r in rows_windows] == [(ITEMS, report.attempt)]
    assert rows_windows[0]["kept"] + rows_windows[0]["dropped"] == report.rows
    events = [e for e in window_log.read_events(spark, pipeline.lake.windows) if e.window.chunk == ROWS_CHUNK]
    assert sorted(e.event for e in events) == [RECONCILED, STAGED]

    def matching(row: tuple) -> bool:
        return row[at["qty"]] in (3, 5) and row[at["id"]] <= 1500

    actual = mirror_rows(spark, mirror_path, table)
    expected = source_rows(config.sources[0], table)
    by_id = {row[at["id"]]: row for row in actual}
    source_by_id = {row[at["id"]]: row for row in expected}
    assert {r for r in actual if matching(r) and r[at["id"]] != GHOST} == {r for r in expected if matching(r)}
    for key in [*TAMPERED_MATCHING, REMOVED_MATCHING]:  # repaired by the ad-hoc snapshot (the writer left them)
        assert by_id[key] == source_by_id[key]
    for key in TAMPERED_OTHERS:  # not matching: untouched
        assert by_id[key][at["name"]] == "tampered" != source_by_id[key][at["name"]]
    assert GHOST in by_id and MOVED_AWAY not in by_id  # never deleted; not matching, not read
    untouched = set(TAMPERED_OTHERS) | {GHOST, MOVED_AWAY}
    assert {r for r in actual if r[at["id"]] not in untouched} == {r for r in expected if r[at["id"]] not in untouched}


def test_injection_attempts_are_refused_with_nothing_recorded(source, spark) -> None:
    admin, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    slot_before = slot_position(admin, DATABASE)
    attempts = [
        ({"column": "id = 1; drop table items", "value": 1}, r"term 1: column 'id = 1; drop table items' is not a "
         r"column of the table; a term names one column \(no expression, no condition\): one of id, name, price"),
        ([{"column": "qty", "value": 3}, {"column": "1=1 or true", "value": 1}], r"term 2: column '1=1 or true'"),
        ({"column": "qty", "op": "= 3 or 1=1 --", "value": 3}, r"term 1: op '= 3 or 1=1 --' is not allowed; allowed: "),
        ({"column": "qty", "value": "3 or 1=1"}, r"filter qty = \"3 or 1=1\": PostgreSQL refuses it: invalid input "
         r"syntax for type integer"),
        ({"column": "uid", "value": "1' or '1'='1"}, r"PostgreSQL refuses it: invalid input syntax for type uuid"),
        ("id = 1 or 1=1", r"filter: expected a term .* never free text"),
    ]  # fmt: skip
    for raw, said in attempts:
        with pytest.raises(RowFilterError, match=said) as refused:
            pipeline.rows_requests([(ITEMS, raw)])
        assert f"table {ITEMS}" in str(refused.value)
    assert window_log.read_events(spark, pipeline.lake.windows) == []
    assert staged_attempts(pipeline, ITEMS) == []
    assert slot_position(admin, DATABASE) == slot_before

    # a value is a literal cast to its column's type, never SQL: it matches no row, and the table is whole
    literal = {"column": "name", "value": "x'; drop table items; --"}
    [(table, row_filter)] = pipeline.rows_requests([(ITEMS, literal)])
    report = pipeline.snapshot_rows(spark, table, row_filter, "literal")
    assert report.rows == 0
    assert admin.execute("select count(*) from items").fetchone() == (2001,)


@pytest.fixture()
def collection_name(mongo_server: str) -> Iterator[tuple[str, pymongo.collection.Collection]]:
    database = f"rows_{uuid.uuid4().hex[:10]}"
    with pymongo.MongoClient(mongo_server) as client:
        yield database, client[database]["orders"]
        client.drop_database(database)


def test_a_filtered_snapshot_on_mongodb_touches_only_matching_documents(
    spark, mongo_server: str, collection_name, tmp_path: Path
) -> None:
    database, orders = collection_name
    orders.insert_many([{"_id": i, "status": "open" if i % 3 == 0 else "closed", "n": i} for i in range(60)])
    config, source_config = mongo_source_config(mongo_server, tmp_path / "lake", database, chunk_size=1000)
    pipeline = CdcPipeline(config, source_config, MongoDialect(source_config, tmp_path / "lake" / "docs" / "_cdc"))
    name = CapturedCollection(database, "orders").qualified_name
    table = pipeline.prepare()[name]
    pipeline.snapshot(spark, table, [0], "initial")
    stream = Stream(pipeline, spark)
    stream.catch_up()

    def documents() -> dict[str, str]:
        frame = spark.read.format("delta").load(pipeline.lake.table(name).mirror)
        return {r["_id"]: r["document"] for r in frame.select("_id", "document").collect()}

    expected = {canonical_json(d["_id"]): canonical_json(d) for d in orders.find()}
    assert documents() == expected
    mirror = DeltaTable.forPath(spark, pipeline.lake.table(name).mirror)
    tampered = F.lit('{"tampered": true}')
    key = {i: canonical_json(i) for i in range(60)}
    mirror.update(F.col("_id").isin(key[3], key[6], key[4], key[5]), {"document": tampered})  # open: 3, 6

    with pytest.raises(RowFilterError, match=r"term 1: column '\$where' is not a field path; allowed"):
        pipeline.rows_requests([(name, {"column": "$where", "value": "sleep(100)"})])
    with pytest.raises(RowFilterError, match=r"term 1: value: .*\$code.* is not an allowed typed value"):
        pipeline.rows_requests([(name, {"column": "status", "value": {"$code": "return true"}})])
    assert all(e.window.chunk != ROWS_CHUNK for e in window_log.read_events(spark, pipeline.lake.windows))
    assert staged_attempts(pipeline, name) == []

    [(requested, row_filter)] = pipeline.rows_requests(
        [(name, [{"column": "status", "value": "open"}, {"column": "n", "op": "<", "value": 30}])]
    )
    orders.update_one({"_id": 9}, {"$set": {"note": "before"}})  # the stream carries it too
    report = pipeline.snapshot_rows(spark, requested, row_filter, "adhoc")
    assert report.rows == 10  # 0, 3, ..., 27
    stream.catch_up()
    actual = documents()
    expected = {canonical_json(d["_id"]): canonical_json(d) for d in orders.find()}
    assert actual[key[3]] == expected[key[3]] and actual[key[6]] == expected[key[6]]  # matching: repaired
    assert actual[key[4]] == actual[key[5]] == '{"tampered": true}'  # not matching: untouched
    others = (key[4], key[5])
    assert {k: v for k, v in actual.items() if k not in others} == {
        k: v for k, v in expected.items() if k not in others
    }


CONFIG = """
lake_root: {lake}
spark: {{master: "local[2]"}}
sources:
  - name: rows
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader, password: "${{ROWS_PW}}"}}
    slot: {database}
    publication: {database}
    chunk_size: 500
    include: ["public.items"]
"""


def test_the_snapshot_rows_job_refuses_bad_config_then_stages_rows_the_stream_reconciles(source, spark) -> None:
    admin, _, config = source
    # the stream starts after the seed rows (the test's administrator moves the slot): only the job reads rows
    admin.execute("select pg_replication_slot_advance(%s, pg_current_wal_lsn())", [DATABASE])
    lake = config.lake_root.parent / "dagster-lake"
    path = lake.parent / "cdc.yaml"
    path.write_text(CONFIG.format(lake=lake, port=PG_PORT, database=DATABASE))
    os.environ["ROWS_PW"] = READER_PASSWORD
    defs = build_definitions(path)
    job = defs.get_job_def("rows_snapshot_rows")
    instance = DagsterInstance.ephemeral()

    def run(tables: list[dict]):
        config = {"tables": tables, "requested_by": "test", "reason": "repair drift"}
        return job.execute_in_process(
            run_config={"ops": {snapshot_rows_op_name("rows"): {"config": config}}}, instance=instance,
            raise_on_error=False,
        )  # fmt: skip

    bad = run([{"table": ITEMS, "where": [{"column": "qty) or (1=1", "op": "=", "value": 3}]}])
    assert not bad.success
    failure = next(e for e in bad.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.event_specific_data.error.cause.message)  # the op's error, under Dagster's step error
    assert f"table {ITEMS}: filter term 1: column 'qty) or (1=1' is not a column of the table" in message, message
    missing = run([{"table": "public.nope", "where": [{"column": "qty", "value": 3}]}])
    assert not missing.success
    source_lake = SourceLake(lake, "rows")
    assert window_log.read_events(spark, source_lake.windows) == []  # nothing recorded
    assert not Path(source_lake.table(ITEMS).staging).exists()  # nothing staged

    good = run([{"table": ITEMS, "where": FILTER[:1]}])
    assert good.success
    [observation] = [
        e.event_specific_data.asset_observation for e in good.all_events if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert observation.asset_key == AssetKey(["rows", "public", "items"])
    assert observation.metadata["filter"].value == "qty in (3, 5)"
    (matching,) = admin.execute("select count(*) from items where qty in (3, 5)").fetchone()
    assert observation.metadata["rows"].value == matching > 0

    stream_asset = next(a for a in defs.assets if stream_asset_key("rows") in a.keys)
    reconciled: list = []
    for _ in range(4):  # a batch reconciles the window once its position passed the high watermark (WAL flush)
        streamed = materialize([stream_asset], resources=defs.resources, instance=instance)
        assert streamed.success
        reconciled += [
            e.event_specific_data.asset_observation.metadata
            for e in streamed.all_events
            if e.event_type_value == "ASSET_OBSERVATION"
            and e.event_specific_data.asset_observation.asset_key == AssetKey(["rows", "public", "items"])
        ]
        if reconciled:
            break
    assert [m["status"].value for m in reconciled] == ["rows reconciled"]
    assert reconciled[0]["kept"].value == matching
    # no chunk was ever snapshotted: the mirror holds exactly the matching rows
    mirrored = spark.read.format("delta").load(source_lake.table(ITEMS).mirror)
    assert mirrored.count() == matching
    assert {r["qty"] for r in mirrored.select("qty").distinct().collect()} == {3, 5}
