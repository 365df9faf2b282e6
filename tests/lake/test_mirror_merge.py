"""``merge_net_changes`` (through ``apply_changes``): the keys the mirror holds in one MERGE, the keys it lacks in an
insert-only MERGE after it, skipped when every upsert updated a row; a batch killed between the two and re-applied
ends as if applied once; ``key_range`` bounds a MERGE to the batch's keys only for types that survive the round trip.
Keys above every key the mirror's files may hold are appended before the MERGE of the others (none when there are
none); a batch killed between the two, or applied twice, ends as if applied once, with no key twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import types as T

import cdc_assets.lake.mirror as mirror_module
from cdc_assets.lake.mirror import META_FIELDS, apply_changes, key_range
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, PgColumn, spark_schema

COLUMNS = [
    PgColumn("id", 20, -1, "bigint", "N", None, None, True),
    PgColumn("note", 25, -1, "text", "S", None, None, False),
]
TEXT_MAP = T.MapType(T.StringType(), T.StringType())
IMAGE = T.StructType([T.StructField("id", T.LongType()), T.StructField("note", T.StringType()),
                      T.StructField(UNREPRESENTABLE_COLUMN, TEXT_MAP)])  # fmt: skip
CHANGES = T.StructType([
    T.StructField("_cdc_op", T.StringType()), T.StructField("_cdc_position", T.LongType()),
    T.StructField("_cdc_seq", T.LongType()), T.StructField("_cdc_ts", T.TimestampType()),
    T.StructField("_cdc_unchanged", T.ArrayType(T.StringType())), T.StructField("after", IMAGE),
    T.StructField("before", IMAGE),
])  # fmt: skip
MIRROR = T.StructType([*[T.StructField(f.name, f.dataType) for f in IMAGE.fields], *META_FIELDS])


class Killed(Exception):
    pass


@pytest.fixture()
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A mirror's path; every mirror of the test takes a batch in two statements (as one of 256 MB or more)."""
    monkeypatch.setattr(mirror_module, "TWO_STATEMENTS_FROM_BYTES", 0)
    return str(tmp_path / "mirror")


def mirror_of(spark, path: str, keys: Sequence[int], top: int = 10_000) -> None:
    """A mirror of ``keys`` and ``top`` (note 'm<key>', position 10), written as a snapshot's appends lay it out (key
    order, several files). ``top``, above every key the tests write, keeps their new keys below the mirror's greatest
    key: they go through the MERGE, not the append of keys above it (tests/lake/test_mirror_append.py)."""
    data = [(k, f"m{k}", None, "r", 10, None, None) for k in sorted({*keys, top})]
    spark.createDataFrame(data, MIRROR).repartitionByRange(4, "id").write.format("delta").save(path)


def apply(spark, path: str, changes: list[tuple[int, str, int, int | None]]) -> None:
    """``changes``: (position, op, key, old key) with note 'n<position>'; a delete's key is its before image's."""
    rows = [
        (op, position, seq, None, [], None if op == "d" else (key, f"n{position}", None),
         (key, None, None) if op == "d" else None if old_key is None else (old_key, None, None))
        for seq, (position, op, key, old_key) in enumerate(changes)
    ]  # fmt: skip
    apply_changes(spark, path, spark.createDataFrame(rows, CHANGES), spark_schema(COLUMNS).fields, ["id"], set())


def rows(spark, path: str) -> dict[int, tuple[str, int]]:
    """The mirror's rows by key, without the ``top`` row of ``mirror_of``."""
    found = spark.read.format("delta").load(path).where("id != 10000").collect()
    return {r["id"]: (r["note"], r["_cdc_position"]) for r in found}


def apply_killed_at(
    spark, path: str, batch: list[tuple[int, str, int, int | None]], point: str, monkeypatch: pytest.MonkeyPatch
) -> dict[int, tuple[str, int]]:
    """``apply`` killed at fault point ``point``, which it must reach; the mirror's rows it left."""

    def kill(name: str) -> None:
        if name == point:
            raise Killed(name)

    monkeypatch.setattr(mirror_module, "fault_point", kill)
    with pytest.raises(Killed):
        apply(spark, path, batch)
    monkeypatch.setattr(mirror_module, "fault_point", lambda name: None)
    return rows(spark, path)


def operations(spark, path: str, since: int) -> list[str]:
    history = DeltaTable.forPath(spark, path).history().where(f"version > {since}").orderBy("version").collect()
    return [h["operation"] for h in history if h["operation"] != "SET TBLPROPERTIES"]  # the mirror's first use


def version(spark, path: str) -> int:
    return DeltaTable.forPath(spark, path).history(1).first()["version"]


def test_updates_and_deletes_of_held_keys_are_one_commit_inserts_a_second(
    spark, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached: list[str] = []  # the fault point between the two statements: reached only when the second one runs
    monkeypatch.setattr(mirror_module, "fault_point", reached.append)
    mirror_of(spark, path, range(1, 201))
    before = version(spark, path)
    apply(spark, path, [(20, "u", 5, None), (20, "d", 7, None), (21, "u", 150, None)])
    assert operations(spark, path, before) == ["MERGE"]
    assert reached == []  # every upsert updated a row: the insert statement was skipped
    expected = {k: (f"m{k}", 10) for k in range(1, 201) if k != 7} | {5: ("n20", 20), 150: ("n21", 21)}
    assert rows(spark, path) == expected
    before = version(spark, path)
    # an update, an insert of a new key, a key change into a new key, an insert deleted again in the batch
    apply(spark, path, [(30, "u", 6, None), (30, "c", 500, None), (31, "u", 501, 8), (32, "c", 502, None),
                        (33, "d", 502, None)])  # fmt: skip
    assert operations(spark, path, before) == ["MERGE", "MERGE"]
    assert reached == ["stream.between_mirror_merges"]
    del expected[8]
    expected |= {6: ("n30", 30), 500: ("n30", 30), 501: ("n31", 31)}
    assert rows(spark, path) == expected


def test_a_batch_killed_between_the_two_merges_ends_as_if_applied_once(
    spark, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = [(40, "u", 3, None), (40, "d", 4, None), (41, "c", 900, None), (42, "u", 901, 9), (43, "u", 900, None)]
    once = str(tmp_path / "once")
    mirror_of(spark, once, range(1, 101))
    apply(spark, once, batch)
    mirror_of(spark, path, range(1, 101))
    half = apply_killed_at(spark, path, batch, "stream.between_mirror_merges", monkeypatch)
    assert 900 not in half and 901 not in half and 9 not in half and 4 not in half  # held keys done, inserts not
    assert half[3] == ("n40", 40)
    apply(spark, path, batch)  # the re-run of the batch
    assert rows(spark, path) == rows(spark, once)
    assert rows(spark, path)[900] == ("n43", 43)
    before = version(spark, path)
    apply(spark, path, batch)  # once more: nothing changes
    assert rows(spark, path) == rows(spark, once)
    assert operations(spark, path, before) == []  # nothing to update or insert: Delta commits neither MERGE


def test_a_mirror_under_the_threshold_takes_a_batch_in_one_merge(spark, path: str, monkeypatch) -> None:
    mirror_of(spark, path, range(1, 101))
    monkeypatch.setattr(mirror_module, "TWO_STATEMENTS_FROM_BYTES", 256 * 1024 * 1024)
    before = version(spark, path)
    apply(spark, path, [(20, "u", 5, None), (20, "c", 500, None), (21, "u", 501, 6)])
    assert operations(spark, path, before) == ["MERGE"]
    expected = {k: (f"m{k}", 10) for k in range(1, 101) if k != 6} | {5: ("n20", 20), 500: ("n20", 20)}
    assert rows(spark, path) == expected | {501: ("n21", 21)}
    before = version(spark, path)
    apply(spark, path, [(30, "c", 20_000, None)])  # above every key: still the one MERGE, no append beside it
    assert operations(spark, path, before) == ["MERGE"]
    assert rows(spark, path)[20_000] == ("n30", 30)


def test_key_range_only_for_types_that_come_back_unchanged(spark) -> None:
    for data_type, low, high in [(T.LongType(), 3, 9), (T.StringType(), "a", "zz"),
                                 (T.DecimalType(12, 2), Decimal("1.10"), Decimal("9.99")),
                                 (T.DateType(), date(2024, 1, 1), date(2024, 2, 1))]:  # fmt: skip
        bounds = key_range("k", data_type, low, high)
        assert bounds is not None
        frame = spark.createDataFrame([(low,), (high,)], T.StructType([T.StructField("k", data_type)]))
        assert frame.where(bounds).count() == 2, data_type
        assert frame.where(~bounds).count() == 0, data_type
    assert key_range("k", T.TimestampType(), datetime(2024, 1, 1), datetime(2024, 2, 1)) is None
    assert key_range("k", T.DoubleType(), 1.0, 2.0) is None
    assert key_range("k", T.LongType(), None, None) is None


def keys_held_once(spark, path: str) -> None:
    mirror = spark.read.format("delta").load(path)
    assert mirror.count() == mirror.select("id").distinct().count()


def test_keys_above_every_mirror_key_are_appended_before_the_merge_of_the_others(
    spark, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached: list[str] = []
    monkeypatch.setattr(mirror_module, "fault_point", reached.append)
    mirror_of(spark, path, range(1, 101), top=200)
    before = version(spark, path)
    # inserts above the mirror's greatest key (200), one updated and one deleted again in the batch: one append
    apply(spark, path, [(20, "c", 300, None), (20, "c", 301, None), (21, "u", 300, None), (22, "c", 302, None),
                        (23, "d", 302, None)])  # fmt: skip
    assert operations(spark, path, before) == ["WRITE"]
    assert reached == ["stream.between_append_and_merge"]
    expected = {k: (f"m{k}", 10) for k in [*range(1, 101), 200]} | {300: ("n21", 21), 301: ("n20", 20)}
    assert rows(spark, path) == expected
    # held keys too: an update, a delete, a key change into a new key, an insert of a gap inside the mirror's range
    batch = [(30, "u", 5, None), (30, "d", 7, None), (31, "u", 400, 8), (32, "c", 401, None), (33, "c", 150, None)]
    reached.clear()
    before = version(spark, path)
    apply(spark, path, batch)
    assert operations(spark, path, before) == ["WRITE", "MERGE", "MERGE"]  # append, held keys, the gap's insert
    assert reached == ["stream.between_append_and_merge", "stream.between_mirror_merges"]
    del expected[7], expected[8]
    expected |= {5: ("n30", 30), 400: ("n31", 31), 401: ("n32", 32), 150: ("n33", 33)}
    assert rows(spark, path) == expected
    before = version(spark, path)
    apply(spark, path, batch)  # again: the appended keys are held now, the MERGE guard leaves them
    assert operations(spark, path, before) == []
    assert rows(spark, path) == expected
    keys_held_once(spark, path)


def test_a_batch_killed_after_its_append_ends_as_if_applied_once(
    spark, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = [(40, "u", 3, None), (40, "d", 4, None), (41, "c", 900, None), (42, "u", 901, 9), (43, "u", 900, None),
             (44, "c", 50, None)]  # fmt: skip
    once = str(tmp_path / "once")
    for target in (once, path):
        mirror_of(spark, target, [k for k in range(1, 101) if k != 50], top=100)
    apply(spark, once, batch)
    half = apply_killed_at(spark, path, batch, "stream.between_append_and_merge", monkeypatch)
    assert half[900] == ("n43", 43) and half[901] == ("n42", 42)  # appended
    assert half[3] == ("m3", 10) and 4 in half and 9 in half and 50 not in half  # the held keys' MERGE not run
    apply(spark, path, batch)  # the re-run of the batch
    assert rows(spark, path) == rows(spark, once)
    assert rows(spark, path)[50] == ("n44", 44) and 9 not in rows(spark, path)
    keys_held_once(spark, path)


def test_a_key_change_into_a_new_key_takes_its_unchanged_values_from_the_old_row(
    spark, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = {"once": True}

    def kill(name: str) -> None:
        if name == "stream.between_append_and_merge" and killed.pop("once", False):
            raise Killed(name)

    monkeypatch.setattr(mirror_module, "fault_point", kill)
    mirror_of(spark, path, range(1, 101), top=100)
    # key 8 becomes 500 (above the mirror) leaving its TOAST note unchanged; key 9 becomes 501 with a new note
    changes = spark.createDataFrame(
        [("u", 50, 0, None, ["note"], (500, None, None), (8, None, None)),
         ("u", 50, 1, None, [], (501, "n50", None), (9, None, None))], CHANGES,
    )  # fmt: skip
    fields = spark_schema(COLUMNS).fields
    with pytest.raises(Killed):  # killed after the append: the re-run finds 500 and 501 held
        apply_changes(spark, path, changes, fields, ["id"], {"note"})
    assert rows(spark, path)[500] == ("m8", 50)
    assert apply_changes(spark, path, changes, fields, ["id"], {"note"}) == []  # no value left unknown
    found = rows(spark, path)
    assert found[500] == ("m8", 50) and found[501] == ("n50", 50) and 8 not in found and 9 not in found
    keys_held_once(spark, path)


def test_string_keys_are_never_appended(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "strings")
    columns = [PgColumn("code", 25, -1, "text", "S", None, None, True)]
    image = T.StructType([T.StructField("code", T.StringType()), T.StructField(UNREPRESENTABLE_COLUMN, TEXT_MAP)])
    schema = T.StructType([*[f if f.name != "after" and f.name != "before" else T.StructField(f.name, image)
                             for f in CHANGES.fields]])  # fmt: skip
    for position, key in ((10, "a"), (11, "b")):  # "b" sorts above every key the mirror holds
        changes = spark.createDataFrame([("c", position, 0, None, [], (key, None), None)], schema)
        before = version(spark, path) if position > 10 else -1
        apply_changes(spark, path, changes, spark_schema(columns).fields, ["code"], set())
    assert operations(spark, path, before) == ["MERGE"]
    assert sorted(r["code"] for r in spark.read.format("delta").load(path).collect()) == ["a", "b"]
