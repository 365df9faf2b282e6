"""Snapshot + stream end to end on real PostgreSQL, Spark and Delta, with a role that cannot write."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from cdc_assets.sources.postgres.pipeline import PostgresPipeline
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
        recorded = report.offset
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


def test_schema_changes_reach_the_mirror_whatever_description_the_stream_run_has(source, spark) -> None:
    """DESIGN.md: a dropped column stays in the mirror, NULL from then on: in every row a change or a re-snapshot
    writes after the drop, whether the stream run described the table before the drop or after it; rows nothing
    wrote since keep the value they had. An added column reaches the mirror with the values a re-snapshot read, even
    when the stream run that reconciles it described the table before the column existed (a long-lived run)."""
    admin, config = source
    before = PostgresPipeline(config, config.sources[0])  # described before the drop and the add
    pairs = before.prepare()["public.pairs"]
    chunks = before.plan(pairs).chunks
    before.snapshot(spark, pairs, list(range(len(chunks))), "initial")
    run_until_reconciled(before, spark)

    admin.execute("alter table pairs drop column label")
    admin.execute("alter table pairs add column tag text default 'dflt'")  # no change carries it to the stream
    after = PostgresPipeline(config, config.sources[0])  # a new run describes the table without label, with tag
    described = [c.name for c in after.prepare()["public.pairs"].columns]
    assert "label" not in described and "tag" in described
    # a re-snapshot after both: its read has no label and every row's tag; the run described before reconciles it
    resnapshotted = chunks[0]
    after.snapshot(spark, after.tables["public.pairs"], [resnapshotted.index], "resnapshot")
    run_until_reconciled(before, spark)  # no change carried tag yet
    admin.execute("update pairs set amount = -amount where region = 1")
    admin.execute("insert into pairs (region, code, amount) values (77, 'after-drop', 7)")
    recorded = run_until_reconciled(before, spark)[-1].offset

    admin.execute("update pairs set amount = -amount where region = 2")
    report = after.stream_batch(spark, recorded, "after-drop")
    assert report.changes > 0
    after.acknowledge(report.offset)

    mirror = spark.read.format("delta").load(after.lake.table("public.pairs").mirror)
    assert "label" in mirror.columns and "tag" in mirror.columns
    rows = {(r["region"], r["code"]): r for r in mirror.select("region", "code", "label", "tag").collect()}
    in_first_chunk = (
        (lambda key: True)
        if resnapshotted.hi is None
        else (lambda key: key < (int(resnapshotted.hi[0]), str(resnapshotted.hi[1])))
    )
    written_after_drop = {key for key in rows if key[0] in (1, 2, 77) or in_first_chunk(key)}
    assert (77, "after-drop") in rows and written_after_drop != set(rows)
    for key, row in rows.items():
        if key in written_after_drop:
            assert row["label"] is None, f"{key}: written after the drop but label is {row['label']!r}"
            assert row["tag"] == "dflt", f"{key}: written after the add but tag is {row['tag']!r}"
        else:
            assert row["label"] == "l" + key[1][1:], f"{key}: nothing wrote it since the drop, label {row['label']!r}"
    # rows written since the changes equal the source in every column it has now (the others cannot know the
    # default: no change of theirs is in the WAL, see docs/known-limits.md)
    expected = source_rows(config.sources[0], after.tables["public.pairs"])
    mirrored = mirror_rows(spark, after.lake.table("public.pairs").mirror, after.tables["public.pairs"])
    assert {r for r in mirrored if r[:2] in written_after_drop} == {r for r in expected if r[:2] in written_after_drop}


def test_a_column_added_after_the_snapshot_run_described_the_table_keeps_its_values(source, spark) -> None:
    """A snapshot run describes the table when it starts, and its reads begin later (Spark start-up, the run
    queue). A column added in between and set by a transaction that commits before the window's low watermark is
    in every row the reads see: the mirror must hold its values, not NULL."""
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    described_before = pipeline.prepare()["public.pairs"]
    chunks = pipeline.plan(described_before).chunks
    admin.execute("alter table pairs add column note text")
    admin.execute("update pairs set note = 'set-' || code where region in (1, 4)")
    pipeline.snapshot(spark, described_before, list(range(len(chunks))), "described-before-the-add")
    run_until_reconciled(pipeline, spark)

    described_now = PostgresPipeline(config, config.sources[0]).prepare()["public.pairs"]
    assert "note" in [c.name for c in described_now.columns]
    mirror = mirror_rows(spark, pipeline.lake.table("public.pairs").mirror, described_now)
    expected = source_rows(config.sources[0], described_now)
    differ = sorted(mirror ^ expected, key=str)
    assert mirror == expected, f"{len(differ)} rows differ, e.g. {differ[:2]}"
