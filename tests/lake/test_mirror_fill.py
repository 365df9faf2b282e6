"""``fill_assignments`` (the ``'f'`` rows of a reconciliation) in a MERGE on a real Delta mirror: only the unknown
columns the source row carries are filled; an unknown column it lacks (dropped at the source since) stays named in
``_cdc_unknown``, never a NULL placeholder."""

from __future__ import annotations

from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import types as T

from cdc_assets.lake.mirror import META_FIELDS, fill_assignments
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN

TEXT_MAP = T.MapType(T.StringType(), T.StringType())


def test_fill_clears_only_the_columns_it_read(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "mirror")
    source_fields = [T.StructField(n, T.StringType()) for n in ("body", "gone", "title")]
    schema = T.StructType(
        [
            T.StructField("id", T.LongType()),
            *source_fields,
            T.StructField(UNREPRESENTABLE_COLUMN, TEXT_MAP),
            *META_FIELDS,
        ]
    )
    rows = [
        (1, None, None, "kept", None, "u", 10, None, ["body", "gone"]),
        (2, None, "g2", "t2", None, "u", 11, None, ["body"]),
        (3, "b3", "g3", "t3", None, "u", 12, None, None),
    ]
    spark.createDataFrame(rows, schema).write.format("delta").save(path)
    read_fields = [T.StructField(n, T.StringType()) for n in ("body", "title")]  # "gone" was dropped since
    current_schema = T.StructType(
        [T.StructField("id", T.LongType()), *read_fields, T.StructField(UNREPRESENTABLE_COLUMN, TEXT_MAP)]
    )
    current = spark.createDataFrame(
        [(1, "read-b1", "newer-t1", None), (2, "read-b2", "newer-t2", None), (3, "read-b3", "newer-t3", None)],
        current_schema,
    )
    names = [f.name for f in read_fields]
    DeltaTable.forPath(spark, path).alias("t").merge(current.alias("s"), "t.id = s.id").whenMatchedUpdate(
        condition="t._cdc_unknown is not null", set=fill_assignments(["id", *names])
    ).execute()
    after = {r["id"]: r for r in spark.read.format("delta").load(path).collect()}
    assert (after[1]["body"], after[1]["gone"], after[1]["title"], after[1]["_cdc_unknown"]) == (
        "read-b1", None, "kept", ["gone"]
    )  # fmt: skip
    assert (after[2]["body"], after[2]["gone"], after[2]["title"], after[2]["_cdc_unknown"]) == (
        "read-b2", "g2", "t2", None
    )  # fmt: skip
    assert (after[3]["body"], after[3]["title"], after[3]["_cdc_unknown"]) == ("b3", "t3", None)
