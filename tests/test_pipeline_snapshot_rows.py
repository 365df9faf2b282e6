"""An ad-hoc snapshot of chosen rows through the generic pipeline (``CdcPipeline.rows_requests`` /
``snapshot_rows``) over the reference dialect (``tests/memory_dialect.py``): no database, real Spark and Delta.

- A table is mirrored exactly; then mirror rows are changed behind the stream's back (matching the filter and not,
  one matching row removed, one row moved to a key the source does not have). The filtered snapshot runs while
  transactions commit between its low watermark and its read and between its read and its high watermark (rows
  moving into and out of the filter, inserts, deletes). After catch-up the matching rows equal the source, the
  tampered rows the filter does not match are untouched, and the row at a key the source lacks is still there: an
  ad-hoc snapshot never deletes.
- A filter with an injection attempt is refused naming the field, and so is a second snapshot of the table while
  the first waits for the stream: nothing is recorded in the window log and nothing is staged.
- A failure at the fault point before the window record leaves no window: the stream reconciles nothing of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F

from cdc_assets.engine.row_filter import RowFilterError, SnapshotRowsRefused
from cdc_assets.engine.windows import RECONCILED, ROWS_CHUNK, STAGED
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.staging import ATTEMPT_FOLDER_PREFIX
from cdc_assets.pipeline import CdcPipeline
from tests.memory_dialect import MemoryDialect
from tests.pipeline_support import FaultPoints, Killed, Stream
from tests.test_pipeline import ITEMS, config_for, mirror_rows, seeded_database

FILTER = [{"column": "qty", "op": "in", "value": [3, 5]}]
TAMPERED_MATCHING = [3, 10, 17]  # qty 3, 3, 3
REMOVED_MATCHING = 5  # qty 5
TAMPERED_OTHERS = [4, 11]  # qty 4
MOVED_AWAY = 6  # qty 6: moved to key -3 with qty 3 in the mirror (a row the source does not have)


def matching(row: dict) -> bool:
    return row["qty"] in (3, 5)


def staged_attempts(pipeline: CdcPipeline) -> list[str]:
    folder = Path(pipeline.lake.table(ITEMS.qualified_name).staging)
    return sorted(p.name for p in folder.glob(f"{ATTEMPT_FOLDER_PREFIX}rows-*")) if folder.exists() else []


def test_a_filtered_snapshot_touches_only_matching_rows_under_concurrent_writes(spark, tmp_path: Path) -> None:
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=40))
    table = pipeline.prepare()[ITEMS.qualified_name]
    pipeline.snapshot(spark, table, list(range(len(pipeline.plan(table).chunks))), "initial")
    stream = Stream(pipeline, spark)
    stream.catch_up()
    assert mirror_rows(spark, pipeline, ITEMS) == database.snapshot(ITEMS.qualified_name)

    mirror_path = pipeline.lake.table(ITEMS.qualified_name).mirror
    mirror = DeltaTable.forPath(spark, mirror_path)
    mirror.update(F.col("id").isin(TAMPERED_MATCHING + TAMPERED_OTHERS), {"name": F.lit("tampered")})
    mirror.delete(F.col("id") == REMOVED_MATCHING)
    mirror.update(F.col("id") == MOVED_AWAY, {"id": F.lit(-3).cast("long"), "qty": F.lit(3).cast("long")})

    read_sees: list[int] = []

    def during_read(name: str, chunk: int) -> None:
        assert (name, chunk) == (ITEMS.qualified_name, ROWS_CHUNK)
        if not read_sees:  # after the low watermark, before the read: the read sees these
            rows = database.rows[name]
            database.commit(
                (name, "update", (24,), {**rows[(24,)], "name": "w1"}),  # matching
                (name, "update", (30,), {**rows[(30,)], "qty": 5}),  # moves into the filter
                (name, "delete", (26,), None),  # matching
                (name, "insert", None, {"id": 500, "name": "new", "qty": 3}),
            )
            read_sees.append(sum(matching(r) for r in database.snapshot(name).values()))
        else:  # after the read, before the high watermark: the read did not see these
            rows = database.rows[name]
            database.commit(
                (name, "update", (31,), {**rows[(31,)], "name": "w2"}),  # matching
                (name, "update", (33,), {**rows[(33,)], "qty": 0}),  # moves out of the filter
                (name, "insert", None, {"id": 501, "name": "new", "qty": 5}),
                (name, "delete", (38,), None),  # matching
            )

    # refused before anything is read: an injection attempt in the column, an unknown operator
    events_before = len(window_log.read_events(spark, pipeline.lake.windows))
    with pytest.raises(RowFilterError, match=r"column 'qty = 3 or 1=1' is not a column of the table.*id, name, qty"):
        pipeline.rows_requests([(ITEMS.qualified_name, {"column": "qty = 3 or 1=1", "value": 1})])
    with pytest.raises(RowFilterError, match=r"op 'or' is not allowed; allowed: =, !=, <"):
        pipeline.rows_requests([(ITEMS.qualified_name, {"column": "qty", "op": "or", "value": 1})])
    with pytest.raises(RowFilterError, match=r"value 'three' is not of column qty's type int64"):
        pipeline.rows_requests([(ITEMS.qualified_name, {"column": "qty", "value": "three"})])
    with pytest.raises(SnapshotRowsRefused, match=r"table 'public.nope' is not captured; captured: .*public.items"):
        pipeline.rows_requests([("public.nope", FILTER)])
    assert len(window_log.read_events(spark, pipeline.lake.windows)) == events_before
    assert staged_attempts(pipeline) == []

    [(requested, row_filter)] = pipeline.rows_requests([(ITEMS.qualified_name, FILTER)])
    assert requested == table and row_filter is not None and row_filter.describe() == "qty in (3, 5)"
    database.during_read = during_read
    report = pipeline.snapshot_rows(spark, table, row_filter, "adhoc")
    database.during_read = None
    assert report.rows == read_sees[0] and report.per_chunk == {ROWS_CHUNK: report.rows}
    staged = [e for e in window_log.read_events(spark, pipeline.lake.windows) if e.window.chunk == ROWS_CHUNK]
    assert [(e.event, e.window.attempt, e.window.rows) for e in staged] == [(STAGED, report.attempt, report.rows)]

    # a second one while the first waits for the stream would supersede it: refused, nothing recorded
    with pytest.raises(SnapshotRowsRefused, match=rf"attempt {report.attempt}, {report.rows} rows.*waits for the"):
        pipeline.refuse_waiting_rows(spark, [ITEMS.qualified_name])
    with pytest.raises(SnapshotRowsRefused, match=r"waits for the stream to pass its high watermark"):
        pipeline.snapshot_rows(spark, table, row_filter, "again")
    assert staged_attempts(pipeline) == [f"{ATTEMPT_FOLDER_PREFIX}{report.attempt}"]

    reconciled = []
    for _ in range(10):
        batch = stream.batch()
        assert batch is not None
        reconciled += batch.rows_windows
        assert batch.reconciled == []  # not a chunk of the table's asset
        if batch.waiting_windows == 0 and batch.changes == 0:
            break
    assert [(r["table"], r["attempt"]) for r in reconciled] == [(ITEMS.qualified_name, report.attempt)]
    # the staged rows that transactions not settled at the low watermark changed are left to the stream: 24, 30,
    # 500 (changed before the read, which saw them) and 31, 33, 38 (changed after it)
    assert reconciled[0]["kept"] == report.rows - 6 and reconciled[0]["dropped"] == 6, reconciled
    events = window_log.read_events(spark, pipeline.lake.windows)
    assert sorted(e.event for e in events if e.window.chunk == ROWS_CHUNK) == [RECONCILED, STAGED]

    source = database.snapshot(ITEMS.qualified_name)
    actual = mirror_rows(spark, pipeline, ITEMS)
    assert {k: r for k, r in actual.items() if matching(r) and k != (-3,)} == {
        k: r for k, r in source.items() if matching(r)
    }
    for key in TAMPERED_OTHERS:  # the filter does not match them: untouched
        assert actual[(key,)]["name"] == "tampered" and source[(key,)]["name"] != "tampered"
    assert actual[(-3,)] == {"id": -3, "name": source[(MOVED_AWAY,)]["name"], "qty": 3}  # never deleted
    assert (MOVED_AWAY,) not in actual  # qty 6: not matching, not read
    untouched = {(k,) for k in TAMPERED_OTHERS} | {(-3,), (MOVED_AWAY,)}
    assert {k: r for k, r in actual.items() if k not in untouched} == {
        k: r for k, r in source.items() if k not in untouched
    }

    # the table's waiting rows window is reconciled: the next one may start
    assert pipeline.rows_requests([(ITEMS.qualified_name, None)]) == [(table, None)]
    pipeline.refuse_waiting_rows(spark, [ITEMS.qualified_name])


def test_a_run_killed_before_its_window_record_leaves_nothing_the_stream_applies(
    spark, tmp_path: Path, faults: FaultPoints
) -> None:
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=40))
    table = pipeline.prepare()[ITEMS.qualified_name]
    [(_, row_filter)] = pipeline.rows_requests([(ITEMS.qualified_name, FILTER)])
    faults.armed.add("snapshot.before_window_record")
    with pytest.raises(Killed):
        pipeline.snapshot_rows(spark, table, row_filter, "killed")
    assert len(staged_attempts(pipeline)) == 1  # staged, but no window names it
    assert window_log.read_events(spark, pipeline.lake.windows) == []
    batch = Stream(pipeline, spark).batch()
    assert batch is not None and batch.rows_windows == [] and batch.waiting_windows == 0
    # the rerun is not refused: no window of the killed run waits
    assert pipeline.snapshot_rows(spark, table, row_filter, "rerun").rows == sum(
        r["qty"] in (3, 5) for r in database.snapshot(ITEMS.qualified_name).values()
    )
