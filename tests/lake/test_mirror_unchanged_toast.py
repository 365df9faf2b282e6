"""``apply_changes`` on hand-built changelog rows: the value of a TOAST column a change left unchanged (pgoutput's
``u``) is the same row's value just before the change, following key changes back through the batch, else the
mirror's row only when that row is older than the change, else unknown (``_cdc_unknown``, never a guess).

Each change is (position, op, new key, old key, {column: value}); a column the change does not name is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import types as T

from cdc_assets.lake.mirror import META_FIELDS, apply_changes
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, PgColumn, spark_schema

TEXT_MAP = T.MapType(T.StringType(), T.StringType())
COLUMNS = [
    PgColumn("id", 20, -1, "bigint", "N", None, None, True),
    PgColumn("note", 25, -1, "text", "S", None, None, False),
    PgColumn("big", 25, -1, "text", "S", None, None, False),
]
IMAGE = T.StructType(
    [T.StructField("id", T.LongType()), T.StructField("note", T.StringType()), T.StructField("big", T.StringType()),
     T.StructField(UNREPRESENTABLE_COLUMN, TEXT_MAP)]
)  # fmt: skip
CHANGES = T.StructType(
    [
        T.StructField("_cdc_op", T.StringType()),
        T.StructField("_cdc_position", T.LongType()),
        T.StructField("_cdc_seq", T.LongType()),
        T.StructField("_cdc_ts", T.TimestampType()),
        T.StructField("_cdc_unchanged", T.ArrayType(T.StringType())),
        T.StructField("after", IMAGE),
        T.StructField("before", IMAGE),
    ]
)
MIRROR = T.StructType([*[T.StructField(f.name, f.dataType) for f in IMAGE.fields], *META_FIELDS])


def mirror_of(spark, path: str, rows: dict[int, tuple[str | None, int, list[str] | None]]) -> None:
    """A mirror holding ``{id: (big, position, unknown)}`` (note = 'm<id>')."""
    data = [(k, f"m{k}", big, None, "u", position, None, unknown) for k, (big, position, unknown) in rows.items()]
    spark.createDataFrame(data, MIRROR).write.format("delta").mode("overwrite").save(path)


def apply(spark, path: str, changes: list[tuple]) -> list[tuple]:
    rows = []
    for seq, (position, op, key, old_key, values) in enumerate(changes):
        unchanged = [] if op == "c" else [c for c in ("big",) if c not in values]
        after = None if op == "d" else (key, values.get("note", f"n{position}"), values.get("big"), None)
        before = None if old_key is None else (old_key, None, None, None)
        rows.append((op, position, seq, None, unchanged, after, before))
    unknown = apply_changes(
        spark, path, spark.createDataFrame(rows, CHANGES), spark_schema(COLUMNS).fields, ["id"], {"big"}
    )
    return sorted(unknown)


def mirror(spark, path: str) -> dict[int, tuple[str | None, list[str] | None]]:
    frame = spark.read.format("delta").load(path)
    return {r["id"]: (r["big"], r["_cdc_unknown"]) for r in frame.collect()}


@pytest.fixture()
def path(tmp_path: Path) -> str:
    return str(tmp_path / "mirror")


def test_the_issues_history_in_one_batch_takes_the_value_from_the_old_key(spark, path: str) -> None:
    """38480 -> 179180 (big unchanged), two updates of 179180, 179180 -> 293675, 179180 inserted again with
    another value, an update of the new 179180: every unchanged value is the 400k-character row's."""
    mirror_of(spark, path, {38480: ("V", 10, None)})
    unknown = apply(spark, path, [
        (100, "u", 179180, 38480, {}),
        (101, "u", 179180, None, {}),
        (102, "u", 179180, None, {}),
        (103, "u", 293675, 179180, {}),
        (104, "c", 179180, None, {"big": "W"}),
        (105, "u", 179180, None, {}),
    ])  # fmt: skip
    assert unknown == []
    assert mirror(spark, path) == {293675: ("V", None), 179180: ("W", None)}


def test_a_chain_of_key_changes_in_one_batch_is_followed_back(spark, path: str) -> None:
    """1 -> 2 -> 3 -> 4 with updates between and the freed keys reused: 4 has 1's value from the mirror; a
    changed value in the chain wins over the mirror's."""
    mirror_of(spark, path, {1: ("V1", 10, None), 11: ("V11", 10, None)})
    unknown = apply(spark, path, [
        (100, "u", 2, 1, {}),
        (101, "u", 2, None, {}),
        (102, "c", 1, None, {"big": "new1"}),
        (103, "u", 3, 2, {}),
        (104, "c", 2, None, {"big": "new2"}),
        (105, "u", 4, 3, {}),
        (106, "u", 4, None, {}),
        (107, "u", 12, 11, {}),
        (108, "u", 12, None, {"big": "changed"}),
        (109, "u", 13, 12, {}),
        (110, "u", 14, 13, {}),
    ])  # fmt: skip
    assert unknown == []
    assert mirror(spark, path) == {
        1: ("new1", None), 2: ("new2", None), 4: ("V1", None), 14: ("changed", None),
    }  # fmt: skip


def test_a_mirror_row_newer_than_the_change_is_not_its_row(spark, path: str) -> None:
    """A re-run after a partial commit: the mirror's row at the old key is a later row (position 300, from the
    earlier attempt) than the one the key change at 100 moved. Its value must not be taken: unknown."""
    mirror_of(spark, path, {2: ("W", 300, None)})
    unknown = apply(spark, path, [(100, "u", 3, 2, {})])
    assert unknown == [(3,)]
    assert mirror(spark, path) == {2: ("W", None), 3: (None, ["big"])}


def test_a_mirror_row_written_by_an_earlier_attempt_of_the_batch_counts_after_its_position(spark, path) -> None:
    """The earlier attempt of a batch applied its changes up to 101 (the row at 2 with value V at position 101);
    the re-run reads further. Changes after 101 of the same row take V; a change before it does not."""
    mirror_of(spark, path, {2: ("V", 101, None), 5: ("X", 10, None)})
    unknown = apply(spark, path, [
        (100, "u", 2, 1, {}),
        (101, "u", 2, None, {}),
        (102, "u", 2, None, {}),
        (103, "u", 6, 5, {}),
    ])  # fmt: skip
    assert unknown == []
    assert mirror(spark, path) == {2: ("V", None), 6: ("X", None)}


def test_a_mirror_value_it_does_not_know_stays_unknown(spark, path: str) -> None:
    mirror_of(spark, path, {1: (None, 10, ["big"]), 2: ("V2", 10, None)})
    unknown = apply(spark, path, [(100, "u", 3, 1, {}), (101, "u", 2, None, {}), (102, "u", 7, None, {})])
    assert unknown == [(3,), (7,)]
    assert mirror(spark, path) == {2: ("V2", None), 3: (None, ["big"]), 7: (None, ["big"])}


def test_a_rerun_of_the_same_batch_changes_nothing(spark, path: str) -> None:
    mirror_of(spark, path, {1: ("V1", 10, None)})
    batch = [(100, "u", 2, 1, {}), (101, "u", 3, 2, {}), (102, "c", 2, None, {"big": "W"}), (103, "u", 3, None, {})]
    apply(spark, path, batch)
    first = mirror(spark, path)
    apply(spark, path, batch)
    assert mirror(spark, path) == first == {2: ("W", None), 3: ("V1", None)}
