"""How a batch's MERGE writes the mirror (``merge_write_conf``): a small mirror rewrites the files a batch touches
(no deletion vectors), a big one marks the replaced rows in deletion vectors; either way the mirror ends with the
same rows, and the session's own setting is back after the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from delta.tables import DeltaTable

import cdc_assets.lake.mirror as mirror_module
from cdc_assets.lake.mirror import (
    MERGE_DELETION_VECTORS,
    REWRITE_FILES_BELOW_BYTES,
    apply_changes,
    ensure_mirror,
    merge_write_conf,
)
from cdc_assets.sources.postgres.pg_values import spark_schema
from tests.lake.test_mirror_merge import CHANGES, COLUMNS, MIRROR


def test_small_mirrors_rewrite_files_big_ones_use_deletion_vectors() -> None:
    assert merge_write_conf(0) == {MERGE_DELETION_VECTORS: "false"}
    assert merge_write_conf(REWRITE_FILES_BELOW_BYTES - 1) == {MERGE_DELETION_VECTORS: "false"}
    assert merge_write_conf(REWRITE_FILES_BELOW_BYTES) == {}
    assert merge_write_conf(10 * REWRITE_FILES_BELOW_BYTES) == {}


def mirror_with_rows(spark, path: str, keys: range) -> None:
    """A mirror as the pipeline creates one (deletion vectors and Change Data Feed on), holding ``keys`` in 2 files
    (note 'm<key>', position 10)."""
    fields = spark_schema(COLUMNS).fields
    ensure_mirror(spark, path, fields, key_columns=["id"])
    data = [(k, f"m{k}", None, "r", 10, None, None) for k in keys]
    spark.createDataFrame(data, MIRROR).repartitionByRange(2, "id").write.format("delta").mode("append").save(path)


def apply_batch(spark, path: str) -> dict[str, str]:
    """Updates of keys 5 and 250, a delete of 7, an insert of 900; the MERGE's operation metrics."""
    rows = [
        ("u", 20, 0, None, [], (5, "n20", None), None),
        ("d", 20, 1, None, [], None, (7, None, None)),
        ("u", 21, 2, None, [], (250, "n21", None), None),
        ("c", 21, 3, None, [], (900, "n21", None), None),
    ]
    changes = spark.createDataFrame(rows, CHANGES)
    apply_changes(spark, path, changes, spark_schema(COLUMNS).fields, ["id"], set())
    last = DeltaTable.forPath(spark, path).history(1).first()
    assert last["operation"] == "MERGE"
    return dict(last["operationMetrics"])


def mirror_rows(spark, path: str) -> dict[int, tuple[str, int]]:
    return {r["id"]: (r["note"], r["_cdc_position"]) for r in spark.read.format("delta").load(path).collect()}


@pytest.mark.parametrize("session_value", [None, "true"])
def test_a_batch_writes_the_same_rows_by_rewrite_or_by_deletion_vectors(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session_value: str | None
) -> None:
    if session_value is not None:
        spark.conf.set(MERGE_DELETION_VECTORS, session_value)
    try:
        small, big = str(tmp_path / "small"), str(tmp_path / "big")
        mirror_with_rows(spark, small, range(1, 301))
        mirror_with_rows(spark, big, range(1, 301))

        rewritten = apply_batch(spark, small)  # a few KB: below the threshold
        assert spark.conf.get(MERGE_DELETION_VECTORS, None) == session_value  # the session's own value is back
        assert int(rewritten["numTargetDeletionVectorsAdded"]) == 0
        assert int(rewritten["numTargetFilesRemoved"]) == 2  # keys 5 and 7 in one file, 250 in the other

        monkeypatch.setattr(mirror_module, "REWRITE_FILES_BELOW_BYTES", 0)  # every mirror counts as big
        marked = apply_batch(spark, big)
        assert spark.conf.get(MERGE_DELETION_VECTORS, None) == session_value
        assert int(marked["numTargetDeletionVectorsAdded"]) == 2
        assert int(marked["numTargetFilesRemoved"]) == 0  # the files stay, their replaced rows marked

        expected = {k: (f"m{k}", 10) for k in range(1, 301) if k != 7} | {
            5: ("n20", 20), 250: ("n21", 21), 900: ("n21", 21)
        }  # fmt: skip
        assert mirror_rows(spark, small) == expected
        assert mirror_rows(spark, big) == expected
    finally:
        spark.conf.unset(MERGE_DELETION_VECTORS)


def test_a_rewrite_drops_the_rows_deletion_vectors_hid(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror written with deletion vectors while it was big, then rewritten while small: the rewritten files hold
    none of the rows the vectors had marked, and no key twice."""
    path = str(tmp_path / "mirror")
    mirror_with_rows(spark, path, range(1, 301))
    monkeypatch.setattr(mirror_module, "REWRITE_FILES_BELOW_BYTES", 0)
    apply_batch(spark, path)  # deletion vectors on both files
    monkeypatch.setattr(mirror_module, "REWRITE_FILES_BELOW_BYTES", 1 << 40)
    rows = [("u", 30, 0, None, [], (6, "n30", None), None), ("u", 30, 1, None, [], (200, "n30", None), None)]
    apply_changes(spark, path, spark.createDataFrame(rows, CHANGES), spark_schema(COLUMNS).fields, ["id"], set())
    metrics = DeltaTable.forPath(spark, path).history(1).first()["operationMetrics"]
    assert int(metrics["numTargetDeletionVectorsAdded"]) == 0
    assert int(metrics["numTargetFilesRemoved"]) == 2
    frame = spark.read.format("delta").load(path)
    assert frame.count() == frame.select("id").distinct().count() == 300  # 300 keys, less 7, plus 900
    found = mirror_rows(spark, path)
    assert found[5] == ("n20", 20) and found[250] == ("n21", 21) and found[6] == ("n30", 30)
    assert 7 not in found and found[900] == ("n21", 21)
