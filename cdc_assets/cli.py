"""Command line: ``python -m cdc_assets.cli offsets`` prints every source's offset and lag as JSON.

Contract: ``offsets_report(config, instance)`` lists, per configured source, the recorded offset (the stream asset's
latest materialization: a batch's, or one the ``change_offset`` job recorded, with its fields in the source kind's
Debezium names; ``changed_by``/``reason`` when the job recorded it), when and by which run it was recorded, its
position and the lake's acknowledged position in the source's own form (PostgreSQL ``X/Y``; MongoDB ``SEC:ORD``),
the lag at the source (``lag_bytes``, ``lag_seconds``, ``changes_waiting``) and why a batch is due now (``pending``,
null when none is). A source that cannot be reached gets ``error`` (its message names the source and never holds a
credential) instead of the figures it could not read; the others are still listed. Nothing is written anywhere:
the report reads the Dagster instance (``DAGSTER_HOME``), the lake's control files and the source.

``main`` exits 0 when every source answered, 1 when one did not (the JSON is printed either way), 2 on bad usage or
configuration (the message names the file or setting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dagster import DagsterInstance

from cdc_assets.assets import stream_asset_key
from cdc_assets.config import CdcConfig, ConfigError, load_config
from cdc_assets.source import SourceError
from cdc_assets.sources import open_source

ROOT = Path(__file__).resolve().parents[1]
# the batch figures of a materialization that are not the offset (``cdc_assets.assets.batch_metadata``)
NOT_OFFSET = ("per_table", "skipped_tables", "history_lost")


def _plain(value: object) -> object:
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


def recorded(instance: DagsterInstance, source_name: str) -> dict[str, Any] | None:
    """The stream asset's latest materialization: its metadata as plain values, when and by which run."""
    event = instance.get_latest_materialization_event(stream_asset_key(source_name))
    if event is None or event.asset_materialization is None:
        return None
    metadata = {name: _plain(value.value) for name, value in event.asset_materialization.metadata.items()}
    return {
        "fields": {k: v for k, v in metadata.items() if k not in NOT_OFFSET},
        "recorded_at": datetime.fromtimestamp(event.timestamp, UTC).isoformat(),
        "run_id": event.run_id,
    }


def offsets_report(config: CdcConfig, instance: DagsterInstance) -> list[dict[str, Any]]:
    report = []
    for source in config.sources:
        entry: dict[str, Any] = {"source": source.name, "kind": source.kind}
        last = recorded(instance, source.name)
        entry["recorded"] = last
        pipeline = open_source(config, source)
        try:
            if last is not None:
                entry["position"] = pipeline.format_position(pipeline.position(last["fields"]))
            acknowledged = pipeline.lake.acknowledged()
            entry["acknowledged"] = None if acknowledged is None else pipeline.format_position(acknowledged)
            lag = pipeline.lag()
            entry["lag_bytes"], entry["lag_seconds"] = lag.lag_bytes, round(lag.lag_seconds, 3)
            entry["changes_waiting"] = lag.changes_waiting
            entry["pending"] = pipeline.pending_work(lag)
        except (SourceError, ValueError, KeyError) as error:
            entry["error"] = f"{type(error).__name__}: {error}"
        report.append(entry)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cdc_assets.cli", description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    offsets = commands.add_parser("offsets", help="every source's recorded offset and lag, as JSON")
    offsets.add_argument(
        "--config", default=os.environ.get("CDC_CONFIG", str(ROOT / "cdc.yaml")),
        help="the configuration file (default: $CDC_CONFIG, else cdc.yaml)",
    )  # fmt: skip
    arguments = parser.parse_args(argv)
    try:
        config = load_config(arguments.config)
    except ConfigError as error:
        print(f"configuration: {error}", file=sys.stderr)
        return 2
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: it names the Dagster instance that holds the recorded offsets", file=sys.stderr)
        return 2
    with DagsterInstance.get() as instance:
        report = offsets_report(config, instance)
    print(json.dumps({"sources": report}, indent=2))
    return 1 if any("error" in entry for entry in report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
