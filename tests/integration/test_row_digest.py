"""Row digests: PostgreSQL (over the source table) and Spark (over the mirror the pipeline wrote) render every type
alike, every column counts, and the database-side checksum of the consistency check agrees with the mirror's."""

from __future__ import annotations

import math

import psycopg
import pytest
from delta.tables import DeltaTable
from psycopg import sql
from pyspark.sql import functions as F

from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, apply_session_settings, spark_schema
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from cdc_assets.sources.postgres.row_digest import (
    mirror_column_texts,
    mirror_key_text,
    mirror_row_digest,
    source_column_texts,
    source_key_text,
    source_row_digest,
)
from tests.integration.support import create_source, drop_source, pipeline_config
from tests.integration.test_consistency import Streamer, check_all
from tests.integration.test_pg_values_copy import COLUMNS_SQL, ROWS, insert_rows
from tests.integration.test_pipeline_guarantees import catch_up

DATABASE = "digest_types"

EXTRA_COLUMNS_SQL = """
    af8 float8[], af4 real[], anu numeric[], bx box[], ach char(4)[], dn price3, ats timestamp[], ajb jsonb[],
    ui uuid[]
"""

ROW_WITH_EVERYTHING = 21


def _fill(admin: psycopg.Connection) -> None:
    insert_rows(admin, "every_type", ROWS)
    admin.execute(
        """
        insert into every_type
        select 21, i2, i4, i8, o, f4, f8, b, n, nu, d, ts, tz, by, u, j, jb, t, vc, ch, nm, tm, ttz, iv, ip, cr, mac,
               m, x, bt, en, rg, ai, at, an, ad, atz, aby, ab,
               '{0.1,NaN,-0,NULL,Infinity,1e300,5e-324}', '{1.1,-Infinity,NULL}', '{1.500,NaN,100,-0.0,NULL}',
               '{(1,1),(0,0);(3,3),(2,2)}', '{a,"b c",NULL,""}', 1.5,
               '{"2024-01-01 10:00:00","0001-01-01 00:00:00.000001",NULL}',
               array['{"a": "x y"}'::jsonb, null, '"q\\"uote"'::jsonb, '{}'::jsonb],
               '{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}'
        from every_type where id = 1
        """
    )
    admin.execute(
        """
        insert into every_type (id, af8, af4, anu, ach, bx, f8, f4, n, nu) values
            (22, '{{1.5,2},{3,4}}', '[2:3]={1,2}', '{1.500,100,-0.0,NULL}', '{}', '{}', '-0'::float8, 5e-45, 0, 0.000),
            (23, '{}', '{NaN}', '{}', '{"NULL",null}', null, 4.9e-324, 3.4028235e38, 99999999.99, 100.10)
        """
    )
    admin.execute("insert into every_type (id, t, ch) values (24, repeat('ü日', 150000), 'x y ')")


@pytest.fixture(scope="module")
def source(postgres_server: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, DATABASE)
    admin = psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True)
    admin.execute("create domain price3 as numeric(6,3)")
    admin.execute(sql.SQL("create table every_type ({}, {})").format(sql.SQL(COLUMNS_SQL), sql.SQL(EXTRA_COLUMNS_SQL)))
    _fill(admin)
    admin.execute(
        "insert into pairs select g % 3, (array['a b', 'ünï', '', 'x\"y', 'NULL'])[g % 5 + 1] || g, g, 'l' || g "
        "from generate_series(1, 900) g"
    )
    admin.execute(f"grant select on every_type to {DATABASE}_reader")
    admin.execute(f"alter publication {DATABASE} add table every_type")
    config = pipeline_config(DATABASE, tmp_path_factory.mktemp("digest") / "lake", chunk_size=250)
    yield admin, config
    admin.close()
    drop_source(admin_dsn, DATABASE)


@pytest.fixture(scope="module")
def mirrored(source, spark):
    """Both tables snapshotted and reconciled into their mirrors by the pipeline."""
    _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    for name in ("public.every_type", "public.pairs"):
        pipeline.snapshot(spark, tables[name], list(range(len(pipeline.plan(tables[name]).chunks))), "initial")
    recorded = catch_up(pipeline, spark, None)
    return pipeline, tables, recorded


def _source_texts(admin: psycopg.Connection, table) -> dict[str, dict[str, str | None]]:
    columns = list(table.columns)
    query = sql.SQL("select {}, {}, {}::text from {}").format(
        source_key_text(columns, table.key_columns),
        sql.SQL(", ").join(source_column_texts(columns)),
        source_row_digest(columns),
        table.identifier,
    )
    apply_session_settings(admin)
    names = [c.name for c in columns] + ["_digest"]
    return {row[0]: dict(zip(names, row[1:], strict=True)) for row in admin.execute(query)}


def _mirror_frame(spark, pipeline: PostgresPipeline, table):
    return spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).mirror)


def _mirror_texts(frame, table) -> dict[str, dict[str, str | None]]:
    columns = list(table.columns)
    names = [c.name for c in columns]
    selected = frame.select(
        mirror_key_text(columns, table.key_columns).alias("_key"),
        *[t.alias(n) for t, n in zip(mirror_column_texts(columns), names, strict=True)],
        mirror_row_digest(columns).cast("string").alias("_digest"),
    )
    return {row["_key"]: {n: row[n] for n in [*names, "_digest"]} for row in selected.collect()}


def test_source_and_mirror_render_every_type_alike(source, mirrored, spark) -> None:
    admin, _ = source
    pipeline, tables, _ = mirrored
    for name in ("public.every_type", "public.pairs"):
        table = tables[name]
        expected = _source_texts(admin, table)
        actual = _mirror_texts(_mirror_frame(spark, pipeline, table), table)
        assert sorted(actual) == sorted(expected), name
        for key, row in expected.items():
            differing = {c: (v, actual[key][c]) for c, v in row.items() if actual[key][c] != v}
            assert not differing, f"{name} key {key!r}: (source, mirror) per column: {differing}"
    texts = _source_texts(admin, tables["public.every_type"])
    by_id = {row["id"]: row for row in texts.values()}
    # the exceptions to PostgreSQL's own text, on both sides alike
    assert by_id["21"]["anu"] == "{1.5,NaN,100,0,NULL}" and by_id["22"]["nu"] == "0" and by_id["23"]["nu"] == "100.1"
    assert by_id["1"]["f8"] == "3fb999999999999a" and by_id["22"]["f8"] == "8000000000000000"
    assert by_id["21"]["af8"].startswith("{3fb999999999999a,NaN,8000000000000000,NULL,7ff0000000000000,")
    assert by_id["22"]["af8"] == "{{1.5,2},{3,4}}" and by_id["22"]["af4"] == "[2:3]={1,2}"
    assert by_id["21"]["ach"] == '{"a   ","b c ",NULL,"    "}' and by_id["24"]["ch"] == "x y "
    assert by_id["21"]["bx"] == "{(1,1),(0,0);(3,3),(2,2)}"


def test_every_column_changes_the_digest(mirrored, spark) -> None:
    pipeline, tables, _ = mirrored
    table = tables["public.every_type"]
    columns = list(table.columns)
    types = {f.name: f.dataType for f in spark_schema(columns).fields}
    row = _mirror_frame(spark, pipeline, table).where(F.col("id") == ROW_WITH_EVERYTHING)
    labels = spark.createDataFrame([(c.name,) for c in columns if c.name != "id"] + [("",)], "_nulled string")
    variants = row.crossJoin(labels)  # one copy of the row per column, that column NULL (and no exact text)
    for column in columns:
        nulled = F.col("_nulled") == column.name
        variants = variants.withColumn(
            column.name, F.when(nulled, F.lit(None).cast(types[column.name])).otherwise(F.col(f"`{column.name}`"))
        )
    variants = variants.withColumn(
        UNREPRESENTABLE_COLUMN, F.map_filter(UNREPRESENTABLE_COLUMN, lambda key, _value: key != F.col("_nulled"))
    )
    digests = {
        r["_nulled"]: r["_digest"]
        for r in variants.select("_nulled", mirror_row_digest(columns).alias("_digest")).collect()
    }
    original = digests.pop("")
    assert len(digests) == len(columns) - 1 > 45
    unchanged = sorted(name for name, digest in digests.items() if digest == original)
    assert unchanged == [], f"a NULL in these columns leaves the digest unchanged: {unchanged}"


def test_database_side_checksum_matches_and_sees_a_one_ulp_change(mirrored, spark) -> None:
    pipeline, tables, recorded = mirrored
    for name in ("public.every_type", "public.pairs"):
        table = tables[name]
        chunks = len(pipeline.plan(table).chunks)
        assert chunks >= (3 if name == "public.pairs" else 1)
        results, recorded = check_all(pipeline, spark, table, chunks, recorded)
        for result in results.values():
            assert result.conclusive and result.matches, result
            assert result.source_rows == result.mirror_rows > 0
    table = tables["public.every_type"]
    mirror = DeltaTable.forPath(spark, pipeline.lake.table(table.qualified_name).mirror)
    mirror.update(F.col("id") == 1, {"f8": F.lit(math.nextafter(0.1, 1.0))})
    streamer = Streamer(pipeline, spark, recorded)  # the single-chunk check, as the Dagster asset check runs it
    streamer.start()
    try:
        (result,) = pipeline.check_chunks(spark, table, [0], wait_seconds=120)
    finally:
        streamer.finish()
    assert result.conclusive and not result.matches
    assert result.source_rows == result.mirror_rows and result.source_checksum != result.mirror_checksum
    assert result.first_difference.startswith("key (id=1): source=")
    assert result.first_difference.endswith("differing columns: f8"), result.first_difference
