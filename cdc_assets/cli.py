"""Command line: ``offsets`` prints every source's offset and lag as JSON; ``backfill`` snapshots a range of a table's
chunks again through the Dagster webserver (``python -m cdc_assets.cli <command> --help``).

Contract: ``offsets_report(config, instance)`` lists, per configured source, the recorded offset (the stream asset's
latest materialization: a batch's, or one the ``change_offset`` job recorded, with its fields in the source kind's
Debezium names; ``changed_by``/``reason`` when the job recorded it), when and by which run it was recorded, its
position and the lake's acknowledged position in the source's own form (PostgreSQL ``X/Y``; MongoDB ``SEC:ORD``),
the lag at the source (``lag_bytes``, ``lag_seconds``, ``changes_waiting``) and why a batch is due now (``pending``,
null when none is). A source that cannot be reached gets ``error`` (its message names the source and never holds a
credential) instead of the figures it could not read; the others are still listed. The sources are asked at once
and waited for ``timeout`` seconds in all (``--timeout``, default 30): a source still silent then (a saturated or
hung server) gets an ``error`` saying so, and the command ends all the same. Nothing is written anywhere:
the report reads the Dagster instance (``DAGSTER_HOME``), the lake's control files and the source.

``backfill_chunks(url, source, table, chunks, tags)`` launches one Dagster asset backfill of the table's chunk
partitions ``chunks`` (``chunk_range``: a chunk number, ``N-M``, a partition key or Dagster's ``START...END``), the
same backfill the UI's "Materialize selected partitions" launches: the webserver's GraphQL ``launchPartitionBackfill``,
so the daemon runs it in runs of ``chunks_per_run`` chunks under the source's pools, and it can be cancelled
(paused) and re-executed from failure (resumed) in the UI. Before anything is launched the table's asset and both
ends of the range must exist among its planned chunks; otherwise ``BackfillRefused`` names the table, the chunk and
the planned range, and nothing is launched. ``tags`` (``cdc/requested_by``, ``cdc/reason``) go on the backfill and
its runs.

``main`` exits 0 on success; ``offsets`` exits 1 when a source did not answer (the JSON is printed either way),
``backfill`` when the webserver refused or could not be reached (the message says why, nothing was launched); 2 on
bad usage or configuration (the message names the file, option or setting).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from dagster import DagsterInstance

from cdc_assets.assets import stream_asset_key, table_asset_key
from cdc_assets.config import CdcConfig, ConfigError, SourceConfig, load_config
from cdc_assets.deadline import Asked, NoAnswer
from cdc_assets.engine.chunks import chunk_index, chunk_partition_key
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


DEFAULT_SOURCE_TIMEOUT = 30.0


def source_figures(config: CdcConfig, source: SourceConfig, last: dict[str, Any] | None) -> dict[str, Any]:
    """What the source and the lake say of ``source``: position, acknowledged position, lag, pending work; ``error``
    instead of the figures it could not read."""
    figures: dict[str, Any] = {}
    try:
        pipeline = open_source(config, source)
        if last is not None:
            figures["position"] = pipeline.format_position(pipeline.position(last["fields"]))
        acknowledged = pipeline.lake.acknowledged()
        figures["acknowledged"] = None if acknowledged is None else pipeline.format_position(acknowledged)
        lag = pipeline.lag()
        figures["lag_bytes"], figures["lag_seconds"] = lag.lag_bytes, round(lag.lag_seconds, 3)
        figures["changes_waiting"] = lag.changes_waiting
        figures["pending"] = pipeline.pending_work(lag)
    except (SourceError, ValueError, KeyError) as error:
        figures["error"] = f"{type(error).__name__}: {error}"
    return figures


def offsets_report(
    config: CdcConfig, instance: DagsterInstance, timeout: float = DEFAULT_SOURCE_TIMEOUT
) -> list[dict[str, Any]]:
    """Every source's entry; the sources are asked at once, and one that has not answered ``timeout`` seconds after
    the command asked gets an ``error`` saying so (its recorded offset is still listed): a source whose server is
    saturated or silent must not hold the report of the others, nor the operator's shell."""
    report, asked = [], []
    for source in config.sources:
        last = recorded(instance, source.name)
        report.append({"source": source.name, "kind": source.kind, "recorded": last})
        asked.append(Asked(f"source {source.name!r}", partial(source_figures, config, source, last)))
    deadline = time.monotonic() + timeout
    for entry, figures in zip(report, asked, strict=True):
        try:
            entry.update(figures.answer(deadline))
        except NoAnswer as silent:
            entry["error"] = (
                f"TimeoutError: {silent.what} did not answer within {timeout:g} s (--timeout): its position, lag and "
                "pending work are left out; its recorded offset is listed"
            )
    return report


DEFAULT_WEBSERVER = "http://127.0.0.1:3000"
CHUNKS_FORMS = "a chunk number (3), a range of numbers (0-9), a partition key (chunk-000003) or START...END of keys"
REQUESTED_BY_TAG, REASON_TAG = "cdc/requested_by", "cdc/reason"
PARTITION_KEYS_QUERY = """
query ChunkPartitions($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    __typename
    ... on AssetNode { partitionKeys }
    ... on Error { message }
  }
}"""
LAUNCH_BACKFILL_MUTATION = """
mutation LaunchChunkBackfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
  }
}"""


class BackfillRefused(Exception):
    """The backfill was not launched: the message names the table, the chunks and why."""


def chunk_range(text: str) -> tuple[str, str]:
    """The first and last chunk partition keys ``--chunks`` names (``CHUNKS_FORMS``); ``ValueError`` names the
    allowed forms."""
    value = text.strip()
    try:
        if "..." in value:
            start, end = (chunk_partition_key(chunk_index(part.strip())) for part in value.split("...", 1))
        elif value.startswith("chunk-"):
            start = end = chunk_partition_key(chunk_index(value))
        elif match := re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", value):
            first = int(match.group(1))
            start, end = chunk_partition_key(first), chunk_partition_key(int(match.group(2) or first))
        else:
            raise ValueError(value)
    except ValueError:
        raise ValueError(f"--chunks {text!r} is not {CHUNKS_FORMS}") from None
    if chunk_index(start) > chunk_index(end):
        raise ValueError(f"--chunks {text!r}: the range starts at {start}, after its end {end}")
    return start, end


def graphql(url: str, query: str, variables: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` of one GraphQL request to the webserver at ``url``; ``BackfillRefused`` when it cannot be reached
    or answers with errors."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise BackfillRefused(f"the Dagster webserver at {url} did not answer (--url): {error}") from None
    if answer.get("errors"):
        raise BackfillRefused(f"the Dagster webserver at {url} refused the request: {answer['errors'][0]['message']}")
    return answer["data"]


def backfill_chunks(url: str, source: str, table: str, chunks: tuple[str, str], tags: dict[str, str]) -> dict[str, Any]:
    """Launch the backfill of ``table``'s chunk partitions ``chunks`` (first, last) through the webserver at ``url``;
    returns its id, the asset, the chunks and the backfill's page. ``BackfillRefused`` when nothing was launched."""
    try:
        key = table_asset_key(source, table)
    except ValueError as error:
        raise BackfillRefused(f"--table {table!r} is not a schema-qualified table name: {error}") from None
    asset = "/".join(key.path)
    node = graphql(url, PARTITION_KEYS_QUERY, {"assetKey": {"path": key.path}})["assetNodeOrError"]
    if node["__typename"] != "AssetNode":
        raise BackfillRefused(
            f"source {source!r} has no asset {asset} for table {table} at {url}: a captured table is an asset once the "
            f"definitions are loaded (a table added at the source appears after 'Reload definitions')"
        )
    planned = node["partitionKeys"]
    if not planned:
        raise BackfillRefused(f"{table} (source {source!r}) has no planned chunks yet: the planner sensor plans them")
    start, end = chunks
    for chunk in (start, end):
        if chunk not in planned:
            raise BackfillRefused(
                f"{chunk} is not a planned chunk of {table} (source {source!r}): its {len(planned)} chunks are "
                f"{planned[0]}...{planned[-1]}"
            )
    params = {
        "partitionsByAssets": [{"assetKey": {"path": key.path}, "partitions": {"range": {"start": start, "end": end}}}],
        "tags": [{"key": k, "value": v} for k, v in tags.items()],
        "title": f"snapshot of {table} chunks {start}...{end}",
        "description": tags.get(REASON_TAG),
    }
    result = graphql(url, LAUNCH_BACKFILL_MUTATION, {"params": params})["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        raise BackfillRefused(f"backfill of {table} chunks {start}...{end} refused: {result.get('message', result)}")
    backfill_id = result["backfillId"]
    return {
        "backfill_id": backfill_id,
        "asset": asset,
        "chunks": planned[planned.index(start) : planned.index(end) + 1],
        "url": f"{url.rstrip('/')}/runs/b/{backfill_id}",
    }


def run_backfill(arguments: argparse.Namespace) -> int:
    try:
        chunks = chunk_range(arguments.chunks)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    tags = {REQUESTED_BY_TAG: arguments.requested_by}
    if arguments.reason:
        tags[REASON_TAG] = arguments.reason
    try:
        launched = backfill_chunks(arguments.url, arguments.source, arguments.table, chunks, tags)
    except BackfillRefused as error:
        print(f"nothing launched: {error}", file=sys.stderr)
        return 1
    print(json.dumps(launched, indent=2))
    return 0


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"--timeout must be a number of seconds above 0, not {text!r}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cdc_assets.cli", description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    offsets = commands.add_parser("offsets", help="every source's recorded offset and lag, as JSON")
    offsets.add_argument(
        "--config", default=os.environ.get("CDC_CONFIG", str(ROOT / "cdc.yaml")),
        help="the configuration file (default: $CDC_CONFIG, else cdc.yaml)",
    )  # fmt: skip
    offsets.add_argument(
        "--timeout", type=positive_seconds, default=DEFAULT_SOURCE_TIMEOUT,
        help=f"seconds to wait for the sources' answers (default {DEFAULT_SOURCE_TIMEOUT:g}); a source still silent "
        "then gets an error in its entry",
    )  # fmt: skip
    backfill = commands.add_parser(
        "backfill", help="snapshot a range of a table's chunks again: one Dagster backfill, launched by the webserver"
    )
    backfill.add_argument("--source", required=True, help="the source's name in cdc.yaml")
    backfill.add_argument("--table", required=True, help="the captured table, schema-qualified (public.orders)")
    backfill.add_argument("--chunks", required=True, help=CHUNKS_FORMS)
    backfill.add_argument(
        "--url", default=os.environ.get("DAGSTER_WEBSERVER_URL", DEFAULT_WEBSERVER),
        help=f"the Dagster webserver (default: $DAGSTER_WEBSERVER_URL, else {DEFAULT_WEBSERVER})",
    )  # fmt: skip
    backfill.add_argument(
        "--requested-by", default=os.environ.get("USER", "cli"), help="who asks (a tag on the backfill and its runs)"
    )
    backfill.add_argument("--reason", default="", help="why (a tag on the backfill and its runs)")
    arguments = parser.parse_args(argv)
    if arguments.command == "backfill":
        return run_backfill(arguments)
    try:
        config = load_config(arguments.config)
    except ConfigError as error:
        print(f"configuration: {error}", file=sys.stderr)
        return 2
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: it names the Dagster instance that holds the recorded offsets", file=sys.stderr)
        return 2
    with DagsterInstance.get() as instance:
        report = offsets_report(config, instance, arguments.timeout)
    print(json.dumps({"sources": report}, indent=2))
    return 1 if any("error" in entry for entry in report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
