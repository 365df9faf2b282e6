"""Issue #24 on real PostgreSQL, Spark and Delta: a large ``text`` column (``storage external``, values of 3-6 KB, so
they are TOASTed out of line) left unchanged by primary-key updates must keep the row's own value, never another
row's that reused a freed key.

Each test runs one pattern on three tables at once (bigint, composite and uuid keys) through
``PostgresPipeline.stream_batch`` and then compares every column of every row with the source. Where the old code
went wrong only when the source moved on before it read a key's current row, the writes that move the key on and
reuse it run right after the batch's slot read (``read_batch`` wrapped): the interleaving of the issue (the key
reused 40 s later, while the batch was still being applied, or re-run after it died), made deterministic.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import functions as F

import cdc_assets.pipeline as pipeline_module
from cdc_assets.sources.postgres import stream as stream_module
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.integration.support import (
    READER_PASSWORD,
    drop_source,
    mirror_rows,
    pipeline_config,
    source_rows,
)
from tests.integration.test_pipeline_guarantees import catch_up, stream_once

DATABASE = "pipe_toast"
SEEDED = 40
SCHEMA_SQL = """
create table hx (id bigint primary key, note text, big text);
create table hc (region int, code text, note text, big text, primary key (region, code));
create table hu (id uuid primary key, note text, big text);
alter table hx alter column big set storage external;
alter table hc alter column big set storage external;
alter table hu alter column big set storage external;
"""


class Keyed:
    """SQL of one table by the number ``n`` of a key: bigint ``n``, composite ``(n % 7, 'c<n>')``, uuid of ``n``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def key(self, n: int) -> list[object]:
        if self.name == "hx":
            return [n]
        if self.name == "hc":
            return [n % 7, f"c{n}"]
        return [str(uuid.uuid5(uuid.NAMESPACE_OID, str(n)))]

    def _columns(self) -> list[str]:
        return ["region", "code"] if self.name == "hc" else ["id"]

    def _match(self) -> sql.Composable:
        cast = "::uuid" if self.name == "hu" else ""
        return sql.SQL(" and ").join(sql.SQL("{} = %s" + cast).format(sql.Identifier(c)) for c in self._columns())

    def _assign(self) -> sql.Composable:
        cast = "::uuid" if self.name == "hu" else ""
        return sql.SQL(", ").join(sql.SQL("{} = %s" + cast).format(sql.Identifier(c)) for c in self._columns())

    def move(self, conn: psycopg.Connection, old: int, new: int) -> None:
        """A primary-key update leaving ``big`` unchanged (pgoutput sends it as ``u``)."""
        query = sql.SQL("update {} set {} where {}").format(sql.Identifier(self.name), self._assign(), self._match())
        assert conn.execute(query, [*self.key(new), *self.key(old)]).rowcount == 1

    def touch(self, conn: psycopg.Connection, n: int) -> None:
        query = sql.SQL("update {} set note = note || '.' where {}").format(sql.Identifier(self.name), self._match())
        assert conn.execute(query, self.key(n)).rowcount == 1

    def insert(self, conn: psycopg.Connection, n: int, big: str) -> None:
        names = [*self._columns(), "note", "big"]
        cast = "::uuid" if self.name == "hu" else ""
        values = [sql.SQL("%s" + cast) if c == "id" else sql.SQL("%s") for c in names]
        query = sql.SQL("insert into {} ({}) values ({})").format(
            sql.Identifier(self.name), sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(", ").join(values)
        )
        conn.execute(query, [*self.key(n), f"new {n}", big])


TABLES = [Keyed("hx"), Keyed("hc"), Keyed("hu")]


def big(n: int, size: int = 3000) -> str:
    """A value of ``size`` characters that names its row."""
    return (f"<{n}>" * size)[:size]


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    """The three tables with ``SEEDED`` rows each, written before the slot exists (the stream does not see them:
    the mirror holds a row once a snapshot read it or a change wrote it)."""
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    drop_source(admin_dsn, DATABASE)
    root = psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True)
    role = f"{DATABASE}_reader"
    root.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
    root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
    root.execute(sql.SQL("create role {} login replication password {}").format(sql.Identifier(role), READER_PASSWORD))
    root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(role)))
    root.close()
    admin = psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True)
    try:
        admin.execute("set synchronous_commit = on")
        admin.execute(SCHEMA_SQL)
        for table in TABLES:
            for n in range(1, SEEDED + 1):
                table.insert(admin, n, big(n, 3000 + 50 * n))
        admin.execute(sql.SQL("grant select on all tables in schema public to {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("create publication {} for table hx, hc, hu").format(sql.Identifier(DATABASE)))
        admin.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [DATABASE])
        yield admin, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=64)
    finally:
        admin.close()
        drop_source(admin_dsn, DATABASE)


def snapshot_all(pipeline: PostgresPipeline, spark) -> int | None:
    for name, table in sorted(pipeline.tables.items()):
        pipeline.snapshot(spark, table, list(range(len(pipeline.plan(table).chunks))), f"all-{name}")
    return catch_up(pipeline, spark, None)


def assert_exact(pipeline: PostgresPipeline, spark, config) -> None:
    for name, table in sorted(pipeline.tables.items()):
        mirror = mirror_rows(spark, pipeline.lake.table(name).mirror, table)
        expected = source_rows(config.sources[0], table)
        wrong = sorted((tuple(str(v)[:12] for v in row) for row in mirror ^ expected), key=lambda row: (row[0], row[1]))
        assert not wrong, f"{name}: {len(wrong)} rows differ between mirror and source: {wrong[:6]}"
        unknown = spark.read.format("delta").load(pipeline.lake.table(name).mirror)
        assert unknown.where(F.col("_cdc_unknown").isNotNull()).count() == 0, f"{name}: unknown values left"


def after_the_slot_read(monkeypatch, admin: psycopg.Connection, writes: Callable[[], None]) -> None:
    """Run ``writes`` once, right after the next batch has read the slot (so they are not in that batch)."""
    original = stream_module.read_batch
    done = []

    def read_then_write(*args, **kwargs):
        batch = original(*args, **kwargs)
        if not done:
            done.append(True)
            with admin.transaction():
                writes()
        return batch

    monkeypatch.setattr(stream_module, "read_batch", read_then_write)


def each_table(admin: psycopg.Connection, step: Callable[[Keyed], None]) -> None:
    with admin.transaction():
        for table in TABLES:
            step(table)


def test_the_issues_history_with_the_freed_key_reused_after_the_batch_was_read(source, spark, monkeypatch) -> None:
    """38480 -> 179180 and two updates of 179180 in one batch (big unchanged throughout); then, before the batch is
    applied, 179180 -> 293675 and 179180 inserted again by another row with another value, and updated. 293675 must
    keep the value 38480 had (the old code resolved 179180 as unknown, read it from the source by key after the
    reuse, and carried the new row's value to 293675)."""
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = snapshot_all(pipeline, spark)
    each_table(admin, lambda t: t.move(admin, 1, 101))
    each_table(admin, lambda t: t.touch(admin, 101))
    each_table(admin, lambda t: t.touch(admin, 101))

    def reuse() -> None:
        for t in TABLES:
            t.move(admin, 101, 201)
            t.insert(admin, 101, big(9101, 5000))
            t.touch(admin, 101)

    after_the_slot_read(monkeypatch, admin, reuse)
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)


def test_a_key_chain_within_one_batch_with_freed_keys_reused_in_it_and_after_it(source, spark, monkeypatch) -> None:
    """2 -> 102, an update, 102 -> 202, 102 inserted again, an update of 202, all in one batch; then 202 -> 302 and
    202 inserted again before the batch is applied: 302 keeps 2's value (a chain of two key changes in a batch)."""
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = snapshot_all(pipeline, spark)
    each_table(admin, lambda t: t.move(admin, 2, 102))
    each_table(admin, lambda t: t.touch(admin, 102))
    each_table(admin, lambda t: t.move(admin, 102, 202))
    each_table(admin, lambda t: t.insert(admin, 102, big(8102)))
    each_table(admin, lambda t: t.touch(admin, 202))

    def reuse() -> None:
        for t in TABLES:
            t.move(admin, 202, 302)
            t.insert(admin, 202, big(8202, 4000))

    after_the_slot_read(monkeypatch, admin, reuse)
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)


def test_a_key_chain_across_batches(source, spark, monkeypatch) -> None:
    """3 -> 103 and an update in one batch, 103 -> 203 and an update in the next, then (before that batch is
    applied) 203 -> 303 and 203 inserted again: 303 keeps 3's value."""
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = snapshot_all(pipeline, spark)
    each_table(admin, lambda t: t.move(admin, 3, 103))
    each_table(admin, lambda t: t.touch(admin, 103))
    recorded, _ = stream_once(pipeline, spark, recorded)
    each_table(admin, lambda t: t.move(admin, 103, 203))
    each_table(admin, lambda t: t.touch(admin, 203))

    def reuse() -> None:
        for t in TABLES:
            t.move(admin, 203, 303)
            t.insert(admin, 203, big(8203, 4500))

    after_the_slot_read(monkeypatch, admin, reuse)
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)


def test_a_batch_rerun_after_it_died_past_its_merge(source, spark, monkeypatch) -> None:
    """The batch of 4 -> 104 and two updates dies right after its mirror MERGE committed (before its offset is
    recorded); meanwhile 104 -> 204 and 104 is inserted again by another row. The re-run of the batch (the same
    nine changes: the batch bound cuts it where the first attempt ended) and the next batch must give 204 the value
    4 had (the old code's re-run found 104 unknown and read it from the source after the reuse)."""
    admin, config = source
    config = pipeline_config(DATABASE, config.lake_root, chunk_size=64, max_changes=9)
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = snapshot_all(pipeline, spark)
    each_table(admin, lambda t: t.move(admin, 4, 104))
    each_table(admin, lambda t: t.touch(admin, 104))
    each_table(admin, lambda t: t.touch(admin, 104))
    original = pipeline_module.apply_changes
    merged = []

    def merge_then_die(*args, **kwargs):
        original(*args, **kwargs)
        merged.append(args[1])
        raise RuntimeError("killed after the MERGE")

    monkeypatch.setattr(pipeline_module, "apply_changes", merge_then_die)
    with pytest.raises(RuntimeError, match="killed after the MERGE"):
        pipeline.stream_batch(spark, recorded, "dies")
    monkeypatch.setattr(pipeline_module, "apply_changes", original)
    assert merged
    each_table(admin, lambda t: t.move(admin, 104, 204))
    each_table(admin, lambda t: t.insert(admin, 104, big(8104, 5000)))
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)


def test_unknown_values_are_filled_only_from_the_same_row(source, spark, monkeypatch) -> None:
    """No snapshot yet: every row reaches the mirror by an update that leaves big unchanged, so big is unknown
    there and must be read from the source. Before that read, 5 -> 105 and 5 is inserted again by another row: the
    mirror's 5 must not take the new row's value (which the next batch would carry to 105)."""
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    with admin.transaction():
        for t in TABLES:
            admin.execute(sql.SQL("update {} set note = note || '!'").format(sql.Identifier(t.name)))

    def reuse() -> None:
        for t in TABLES:
            t.move(admin, 5, 105)
            t.insert(admin, 5, big(8005, 5000))

    after_the_slot_read(monkeypatch, admin, reuse)
    catch_up(pipeline, spark, None)
    assert_exact(pipeline, spark, config)
