"""The ``<source>_snapshot_rows`` job refuses bad config before anything is read: Dagster's config schema refuses
unknown or missing fields, and the source's validation (``rows_requests``) refuses a filter naming the table, the term
and the field, before the run starts Spark or opens a window. Run in process over the reference dialect
(``tests/memory_dialect.py``) with a resource whose Spark session may not start; the job's reads and the stream's
reconciliation on real PostgreSQL are in ``tests/integration/test_snapshot_rows.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DagsterInvalidConfigError, ExecuteInProcessResult

from cdc_assets.pipeline import CdcPipeline
from cdc_assets.snapshot_rows import build_snapshot_rows_job, snapshot_rows_op_name
from tests.memory_dialect import MemoryDialect
from tests.test_pipeline import config_for, seeded_database


class NoSparkResource:
    """The job's ``cdc`` resource over the reference dialect; starting Spark fails the test."""

    def __init__(self, pipeline: CdcPipeline) -> None:
        self.source_pipeline = pipeline

    def pipeline(self, source_name: str) -> CdcPipeline:
        assert source_name == self.source_pipeline.source.name
        return self.source_pipeline

    def spark(self) -> None:
        raise AssertionError("Spark was started before the run config was refused")


def run(tmp_path: Path, tables: list[dict], **fields: object) -> ExecuteInProcessResult:
    config, source = config_for(tmp_path / "lake", max_changes=100)
    pipeline = CdcPipeline(config, source, MemoryDialect(seeded_database(), chunk_size=40))
    job = build_snapshot_rows_job(source)
    run_config = {"tables": tables, "requested_by": "test", "reason": "repair", **fields}
    return job.execute_in_process(
        run_config={"ops": {snapshot_rows_op_name(source.name): {"config": run_config}}},
        resources={"cdc": NoSparkResource(pipeline)},
        raise_on_error=False,
    )


def failure_message(result: ExecuteInProcessResult) -> str:
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error, messages = failure.event_specific_data.error, []
    while error is not None:  # Dagster's step error, caused by the op's own (what the run's log shows)
        messages.append(error.message)
        error = error.cause
    return "\n".join(messages)


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ([{"column": "qty = 3 or 1=1", "op": "=", "value": 1}],
         "RowFilterError: table public.items: filter term 1: column 'qty = 3 or 1=1' is not a column of the table; "
         "a term names one column (no expression, no condition): one of id, name, qty"),
        ([{"column": "qty", "value": 1}, {"column": "qty", "op": "; drop table items", "value": 1}],
         "filter term 2: op '; drop table items' is not allowed; allowed: =, !=, <, <=, >, >=, in, not in"),
        ([{"column": "qty", "op": "in", "value": 3}], "filter term 1: op 'in' takes a list of values, got 3"),
        ([{"column": "name", "value": 7}], "filter term 1: value 7 is not of column name's type string"),
        ([], "an empty list of terms"),
    ],
)  # fmt: skip
def test_a_bad_filter_fails_the_run_naming_the_field_before_spark_starts(
    tmp_path: Path, where: list[dict], said: str
) -> None:
    assert said in failure_message(run(tmp_path, [{"table": "public.items", "where": where}]))
    assert not (tmp_path / "lake").exists()  # nothing staged, nothing recorded


def test_a_table_not_captured_or_named_twice_fails_the_run(tmp_path: Path) -> None:
    message = failure_message(run(tmp_path, [{"table": "public.orders"}]))
    assert "table 'public.orders' is not captured; captured: app.notes, public.items" in message
    twice = [{"table": "public.items"}, {"table": "public.items", "where": [{"column": "qty", "value": 1}]}]
    assert "tables: public.items named more than once" in failure_message(run(tmp_path, twice))
    assert "tables: name at least one table" in failure_message(run(tmp_path, []))


def test_unknown_or_missing_config_fields_are_refused_by_the_schema(tmp_path: Path) -> None:
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "sql"'):
        run(tmp_path, [{"table": "public.items", "where": [{"column": "qty", "value": 1, "sql": "1=1"}]}])
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "condition"'):
        run(tmp_path, [{"table": "public.items", "condition": "qty = 1 or true"}])
    _, source = config_for(tmp_path / "lake", max_changes=100)
    job = build_snapshot_rows_job(source)
    with pytest.raises(DagsterInvalidConfigError, match=r'Missing required config entry "reason"'):
        job.execute_in_process(
            run_config={"ops": {snapshot_rows_op_name("memory"): {"config": {"tables": [], "requested_by": "x"}}}},
            resources={"cdc": object()},
        )
