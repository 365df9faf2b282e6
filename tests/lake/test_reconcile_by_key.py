"""``reconcile`` of by-key windows on a real Delta mirror: a fill window (``FILL_CHUNK``) and a rows window (an ad-hoc
snapshot of chosen rows, ``ROWS_CHUNK``) of one table can stage the same key; reconciled in one call, each gets a
MERGE of its own, oldest high watermark first, so the key is in the mirror once, with the newer window's row, in
whichever order the windows come. Neither deletes a mirror row the read did not see."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from cdc_assets.engine.chunks import Chunk
from cdc_assets.engine.windows import FILL_CHUNK, ROWS_CHUNK, ChunkWindow
from cdc_assets.lake import staging
from cdc_assets.lake.mirror import reconcile
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE, spark_fields
from tests.memory_dialect import MemorySettledRule

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
FIELDS = spark_fields(SCHEMA.append(pa.field(UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE)))
AT = datetime(2026, 1, 1, tzinfo=UTC)


def stage(folder: Path, attempt: str, chunk: int, rows: list[tuple[int, str]]) -> int:
    table = pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "name": pa.array([r[1] for r in rows], pa.string()),
            UNREPRESENTABLE_COLUMN: pa.nulls(len(rows), UNREPRESENTABLE_TYPE),
        }
    )
    schema = SCHEMA.append(pa.field(UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE))
    return staging.write_part(str(folder), attempt, chunk, 0, [table], schema)


@pytest.mark.parametrize("rows_first", [False, True])
def test_a_fill_and_a_rows_window_of_the_same_key_are_reconciled_one_merge_each(
    spark, tmp_path: Path, rows_first: bool
) -> None:
    mirror, changelog, folder = str(tmp_path / "mirror"), str(tmp_path / "changelog"), tmp_path / "staged"
    old = ChunkWindow("public.t", 0, "chunk-a", 1, "1", 5, stage(folder, "chunk-a", 0, [(1, "old"), (9, "gone")]), AT)
    whole = {0: Chunk(0, None, None)}
    reconcile(spark, mirror, changelog, str(folder), FIELDS, ("id",), [old], whole, MemorySettledRule())
    fill_rows = stage(folder, "fill-b", FILL_CHUNK, [(1, "fill")])
    rows_rows = stage(folder, "rows-c", ROWS_CHUNK, [(1, "rows"), (2, "new")])
    fill = ChunkWindow("public.t", FILL_CHUNK, "fill-b", 6, "6", 10, fill_rows, AT)
    rows = ChunkWindow("public.t", ROWS_CHUNK, "rows-c", 7, "7", 20, rows_rows, AT)
    windows = [rows, fill] if rows_first else [fill, rows]
    results = reconcile(spark, mirror, changelog, str(folder), FIELDS, ("id",), windows, {}, MemorySettledRule())
    assert sorted((r.chunk, r.kept, r.dropped, r.deleted) for r in results) == [(ROWS_CHUNK, 2, 0, 0),
                                                                                (FILL_CHUNK, 1, 0, 0)]  # fmt: skip
    found = spark.read.format("delta").load(mirror).select("id", "name", "_cdc_position").collect()
    # key 1 once, the newer window's row; 9 (not read by either) kept: by-key windows never delete
    assert sorted(tuple(r) for r in found) == [(1, "rows", 20), (2, "new", 20), (9, "gone", 5)]
