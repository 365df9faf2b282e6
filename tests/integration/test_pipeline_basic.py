"""Snapshot + stream end to end on real PostgreSQL, Spark and Delta, with a role that cannot write."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from cdc_assets.lake.pipeline import PostgresPipeline
from tests.integration.support import mirror_rows, pipeline_config, seeded_source, source_rows

DATABASE = "pipe_basic"


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    with seeded_source(postgres_server, DATABASE) as (admin, _):
        yield admin, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=250)


def run_until_reconciled(pipeline: PostgresPipeline, spark, rounds: int = 10) -> list:
    reports = []
    recorded = None
    for _ in range(rounds):
        report = pipeline.stream_batch(spark, recorded, "test")
        reports.append(report)
        recorded = int(report.offset["lsn"].split("/")[0], 16) << 32 | int(report.offset["lsn"].split("/")[1], 16)
        pipeline.acknowledge(recorded)
        if report.waiting_windows == 0 and report.changes == 0:
            break
    return reports


def test_snapshot_then_stream_matches_source(source, spark) -> None:
    admin, config = source
    reader = psycopg.connect(**config.sources[0].connection.kwargs())
    # the pipeline's role can read and decode, nothing else
    assert reader.execute("show default_transaction_read_only").fetchone() == ("on",)
    assert reader.execute(
        "select bool_or(has_table_privilege(c.oid, 'INSERT,UPDATE,DELETE,TRUNCATE')) from pg_class c "
        "where relnamespace = 'public'::regnamespace and relkind = 'r'"
    ).fetchone() == (False,)
    reader.close()
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    for table in tables.values():
        plan = pipeline.plan(table)
        assert len(plan.chunks) >= 2
        pipeline.snapshot(spark, table, list(range(len(plan.chunks))), "test")
    # changes after the snapshot: updates, deletes, key change, toast-unchanged update, insert
    admin.execute("update items set qty = -1 where id % 10 = 0")
    admin.execute("delete from items where id % 13 = 0")
    admin.execute("update pairs set code = code || '-moved' where region = 3")
    admin.execute("update docs set title = 'retitled' where title like 't1%'")
    admin.execute("insert into items (id, name) values (5000, 'late')")
    # an added column evolves the mirror's schema (rows written before it keep NULL, as at the source)
    admin.execute("alter table pairs add column extra numeric(8, 3)")
    admin.execute("update pairs set extra = amount / 7.0 where region = 5")
    admin.execute("insert into pairs (region, code, amount, extra) values (99, 'new', 1, 'NaN')")
    run_until_reconciled(pipeline, spark)
    tables = PostgresPipeline(config, config.sources[0]).prepare()  # as the next run sees the source
    assert "extra" in [c.name for c in tables["public.pairs"].columns]
    for name, table in tables.items():
        mirror = mirror_rows(spark, pipeline.lake.table(name).mirror, table)
        expected = source_rows(config.sources[0], table)
        differ = sorted(mirror ^ expected, key=str)
        assert mirror == expected, f"{name}: {len(differ)} rows differ, e.g. {differ[:2]}"
