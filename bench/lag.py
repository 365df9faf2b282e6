"""Benchmark 3: the stream's lag while a full snapshot of a big table runs.

    .venv/bin/python -m bench.lag --rows 10000000

Processes, as Dagster would run them (each run its own Spark driver):

- a **stream worker**: ``stream_batch`` + ``acknowledge`` back to back for source ``bench_lag`` (tables
  ``bench_snap_<rows>``, the snapshot benchmark's table, reused, and ``bench_hot``);
- a **workload** thread here: ``--rate`` changes/s (transactions of 10: inserts, updates, deletes) into
  ``bench_hot`` (``--hot-rows`` rows), from the start to the end;
- a **snapshot worker**, started after ``--baseline-seconds``: plans ``bench_snap_<rows>`` and snapshots all its
  chunks (``--chunks-per-call`` per call); the stream reconciles them as their windows close.

Sampled here every ``--sample-seconds``: **lag bytes** = server flush LSN - the slot's ``confirmed_flush_lsn``
(cluster-wide WAL, so other databases' writes count too, as for any slot) and **lag seconds** = age of the oldest
workload commit the slot has not passed yet (the workload records the WAL insert position after each of its
steps, 0.1 s apart; 0 when nothing of the workload is pending). Reported per phase: baseline (stream + workload
only), snapshot start-up (the snapshot worker's Spark start, prepare, plan), snapshot reads (first to last
snapshot call), reconciliation (until a batch reports no staged chunk waiting), tail + drain (``--tail-seconds``,
then until the stream has passed the WAL written before the workload stopped); plus the stream batches' own
figures (changes, seconds, reported lag at their end).

Output: results table, ``bench/out/lag-<utc>.json``, ``bench/out/lag.png`` (lag bytes and seconds over time with
the phases shaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    MB,
    admin_connect,
    drop_capture,
    ensure_database,
    fresh_dir,
    machine,
    percentile,
    pipeline_config,
    print_table,
    pyplot,
    remove_dir,
    reset_capture,
    save_figure,
    save_json,
    start_worker,
)
from bench.datagen import PacedWorkload, create_hot_table, ensure_table, install_workload
from cdc_assets.sources.postgres.snapshot import take_inserted_wal_end

SOURCE = "bench_lag"
HOT = "bench_hot"


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _event(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps({"wall": time.time(), **payload}, default=str) + "\n")


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# workers


def _pipeline(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from cdc_assets.lake.spark import spark_session
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline

    config = pipeline_config(SOURCE, Path(args.lake), [args.table, HOT], chunk_size=args.chunk_size)
    spark = spark_session(config.spark)
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    return spark, pipeline, tables


def worker_stream(args: argparse.Namespace) -> None:
    events = Path(args.events)
    stop = Path(args.stop_file)
    _event(events, {"kind": "stream_start"})
    spark, pipeline, _ = _pipeline(args)
    _event(events, {"kind": "stream_ready"})
    run_id = f"bench-stream-{uuid.uuid4().hex[:8]}"
    recorded = None
    while True:
        report = pipeline.stream_batch(spark, recorded, run_id)
        recorded = report.offset
        pipeline.acknowledge(recorded)
        applied = pipeline.position(recorded)
        _event(events, {"kind": "batch", "changes": report.changes, "seconds": report.seconds,
                        "lag_bytes": report.lag_bytes, "lag_seconds": report.lag_seconds, "applied": applied,
                        "reconciled": len(report.reconciled), "waiting": report.waiting_windows,
                        "phases": getattr(report, "phase_seconds", {})})  # fmt: skip
        if stop.exists() and report.waiting_windows == 0 and applied >= int(stop.read_text() or 0):
            break
    spark.stop()


def worker_snapshot(args: argparse.Namespace) -> None:
    events = Path(args.events)
    _event(events, {"kind": "snapshot_start"})
    spark, pipeline, tables = _pipeline(args)
    table = tables[f"public.{args.table}"]
    plan = pipeline.plan(table)
    indexes = [c.index for c in plan.chunks]
    _event(events, {"kind": "snapshot_ready", "chunks": len(indexes)})
    run_id = f"bench-snapshot-{uuid.uuid4().hex[:8]}"
    for start in range(0, len(indexes), args.chunks_per_call):
        group = indexes[start : start + args.chunks_per_call]
        _event(events, {"kind": "call_start", "chunks": group})
        report = pipeline.snapshot(spark, table, group, run_id)
        _event(events, {"kind": "call_end", "chunks": group, "rows": report.rows, "seconds": report.seconds})
    spark.stop()


# ---------------------------------------------------------------------------------------------------------------
# parent


class LagSampler:
    """Samples (wall time, server flush LSN, slot confirmed LSN) from an administrator session."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-lag", daemon=True)

    def start(self) -> LagSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        with admin_connect() as conn:
            while not self._stop.wait(self.interval):
                row = conn.execute(
                    "select pg_current_wal_flush_lsn()::text, confirmed_flush_lsn::text "
                    "from pg_replication_slots where slot_name = %s",
                    [SOURCE],
                ).fetchone()
                if row is not None:
                    self.samples.append((time.time(), lsn_int(row[0]), lsn_int(row[1])))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class MarkedWorkload(PacedWorkload):
    """The paced workload, also recording (wall time, end of the inserted WAL) after each step (the raw insert
    position past an empty page's header is one the slot never passes while the server idles)."""

    marks: list[tuple[float, int]] = field(default_factory=list)

    def after_step(self, conn: psycopg.Connection) -> None:
        self.marks.append((time.time(), take_inserted_wal_end(conn)))


def lag_seconds(marks: list[tuple[float, int]], at: float, confirmed: int) -> float:
    """Age at ``at`` of the oldest workload step whose WAL the slot has not passed (0 when none)."""
    for when, lsn in marks:
        if when > at:
            break
        if lsn > confirmed:
            return at - when
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the snapshotted table (default 10M)")
    parser.add_argument("--chunk-size", type=int, default=250_000)
    parser.add_argument("--chunks-per-call", type=int, default=4)
    parser.add_argument("--rate", type=float, default=500.0, help="workload changes per second (default 500)")
    parser.add_argument("--hot-rows", type=int, default=100_000)
    parser.add_argument("--baseline-seconds", type=float, default=60.0)
    parser.add_argument("--tail-seconds", type=float, default=30.0)
    parser.add_argument("--sample-seconds", type=float, default=0.5)
    parser.add_argument("--keep", action="store_true", help="keep the lake under bench/out/work")
    parser.add_argument("--worker", choices=["stream", "snapshot"], help=argparse.SUPPRESS)
    parser.add_argument("--lake", help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "stream":
        worker_stream(args)
        return 0
    if args.worker == "snapshot":
        worker_snapshot(args)
        return 0

    ensure_database()
    install_workload()
    table = f"bench_snap_{args.rows}"
    built = ensure_table(table, args.rows)
    create_hot_table(HOT, args.hot_rows)
    lake = fresh_dir("lag")
    with admin_connect() as conn:
        reset_capture(conn, SOURCE, [table, HOT])
    try:
        result = run(args, lake, table)
    finally:
        with admin_connect() as conn:
            drop_capture(conn, SOURCE)
        if not args.keep:
            remove_dir(lake)
    result["table_built"] = built
    report(result, args)
    path = save_json("lag", {"args": vars(args), **result})
    print(f"\nresults: {path}", flush=True)
    return 0


def _wait(predicate: Any, what: str, timeout: float, processes: list[Any]) -> None:
    deadline = time.time() + timeout
    while not predicate():
        for process in processes:
            if process.poll() not in (None, 0):
                raise RuntimeError(f"a worker failed while waiting for {what} (exit {process.returncode})")
        if time.time() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def run(args: argparse.Namespace, lake: Path, table: str) -> dict[str, Any]:
    events = lake / "events.jsonl"
    stop_file = lake / "stop"
    common = ["--lake", str(lake), "--table", table, "--events", str(events), "--chunk-size", str(args.chunk_size)]
    sampler = LagSampler(args.sample_seconds).start()
    workload = MarkedWorkload(HOT, args.rate).start()
    started = time.time()
    stream, stream_log = start_worker("bench.lag", ["--worker", "stream", "--stop-file", str(stop_file), *common],
                                      "lag-stream")  # fmt: skip
    snapshot = None
    try:

        def kinds() -> list[str]:
            return [e["kind"] for e in _read_events(events)]

        _wait(lambda: "batch" in kinds(), "the first stream batch", 600, [stream])
        baseline_from = time.time()
        print(f"[lag] stream running ({baseline_from - started:.1f} s to first batch); baseline "
              f"{args.baseline_seconds:.0f} s", flush=True)  # fmt: skip
        time.sleep(args.baseline_seconds)
        snapshot, _ = start_worker("bench.lag", ["--worker", "snapshot", "--chunks-per-call",
                                                 str(args.chunks_per_call), *common], "lag-snapshot")  # fmt: skip
        print("[lag] snapshot worker started", flush=True)
        _wait(lambda: snapshot.poll() is not None, "the snapshot worker", 3600, [stream])
        if snapshot.returncode != 0:
            raise RuntimeError(
                f"snapshot worker failed (exit {snapshot.returncode}); see bench/out/logs/lag-snapshot.log"
            )
        snapshot_done = time.time()
        print("[lag] snapshot reads done; waiting for reconciliation", flush=True)

        def reconciled() -> bool:
            batches = [e for e in _read_events(events) if e["kind"] == "batch" and e["wall"] > snapshot_done]
            return any(b["waiting"] == 0 for b in batches)

        _wait(reconciled, "reconciliation of every chunk", 3600, [stream])
        reconciled_at = time.time()
        print(f"[lag] every chunk reconciled {reconciled_at - snapshot_done:.1f} s after the last read", flush=True)
        time.sleep(args.tail_seconds)
    finally:
        changes = workload.stop()
        with admin_connect() as conn:
            (target,) = conn.execute("select pg_current_wal_flush_lsn()::text").fetchone()
        stop_file.write_text(str(lsn_int(target)))
        try:
            stream.wait(timeout=600)
        finally:
            for process in (stream, snapshot):
                if process is not None and process.poll() is None:
                    process.kill()
            sampler.stop()
    if stream.returncode != 0:
        raise RuntimeError(f"stream worker failed (exit {stream.returncode}); see {stream_log}")
    ended = time.time()
    all_events = _read_events(events)
    marks = workload.marks
    samples = [
        {"t": t - started, "lag_bytes": max(0, flush - confirmed), "lag_seconds": lag_seconds(marks, t, confirmed)}
        for t, flush, confirmed in sampler.samples
    ]
    calls = [e for e in all_events if e["kind"] in ("call_start", "call_end")]
    snap_events = {e["kind"]: e for e in all_events if e["kind"] in ("snapshot_start", "snapshot_ready")}
    phases = {
        "baseline": (baseline_from - started, baseline_from - started + args.baseline_seconds),
        "snapshot start-up": (snap_events["snapshot_start"]["wall"] - started, calls[0]["wall"] - started),
        "snapshot reads": (calls[0]["wall"] - started, calls[-1]["wall"] - started),
        "reconciliation": (calls[-1]["wall"] - started, reconciled_at - started),
        "tail + drain": (reconciled_at - started, ended - started),
    }
    return {
        "machine": machine(),
        "rows": args.rows,
        "rate": args.rate,
        "workload_changes": changes,
        "seconds": ended - started,
        "phases": phases,
        "samples": samples,
        "batches": [{**e, "t": e["wall"] - started} for e in all_events if e["kind"] == "batch"],
        "snapshot_calls": [{**e, "t": e["wall"] - started} for e in calls if e["kind"] == "call_end"],
        "snapshot_spark_start": snap_events["snapshot_ready"]["wall"] - snap_events["snapshot_start"]["wall"],
        "snapshot_read_seconds": calls[-1]["wall"] - calls[0]["wall"],
    }


def phase_stats(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, (lo, hi) in result["phases"].items():
        inside = [s for s in result["samples"] if lo <= s["t"] <= hi]
        lag_b = [s["lag_bytes"] / MB for s in inside]
        lag_s = [s["lag_seconds"] for s in inside]
        batches = [b for b in result["batches"] if lo <= b["t"] <= hi]
        applied = sum(b["changes"] for b in batches)
        rows.append([name, hi - lo, len(inside), percentile(lag_b, 50), percentile(lag_b, 95), max(lag_b, default=None),
                     percentile(lag_s, 50), percentile(lag_s, 95), max(lag_s, default=None), len(batches),
                     applied / (hi - lo) if hi > lo else None])  # fmt: skip
    return rows


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print()
    print_table(
        f"Stream lag during a full snapshot ({machine()}; {args.rows:,} rows snapshotted, chunk_size "
        f"{args.chunk_size:,}, {args.chunks_per_call} chunks/call; workload {args.rate:.0f} changes/s)",
        ["phase", "seconds", "samples", "MB p50", "MB p95", "MB max", "s p50", "s p95", "s max", "batches",
         "applied/s"],
        phase_stats(result),
    )  # fmt: skip
    rows_per_second = args.rows / result["snapshot_read_seconds"] if result["snapshot_read_seconds"] else 0
    print(f"  snapshot worker: Spark start {result['snapshot_spark_start']:.1f} s, reads of all chunks "
          f"{result['snapshot_read_seconds']:.1f} s ({rows_per_second:,.0f} rows/s while streaming)")  # fmt: skip
    print(f"  workload: {result['workload_changes']:,} changes in {result['seconds']:.0f} s")
    plot(result)


def plot(result: dict[str, Any]) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t = [s["t"] for s in result["samples"]]
    top.plot(t, [s["lag_bytes"] / MB for s in result["samples"]], label="slot lag (MB)")
    bottom.plot(t, [s["lag_seconds"] for s in result["samples"]], label="oldest pending workload commit (s)")
    colours = {"baseline": "#dddddd", "snapshot start-up": "#fff3bf", "snapshot reads": "#ffd8a8",
               "reconciliation": "#c3fae8", "tail + drain": "#eeeeee"}  # fmt: skip
    for name, (lo, hi) in result["phases"].items():
        for ax in (top, bottom):
            ax.axvspan(lo, hi, color=colours.get(name, "#eeeeee"), alpha=0.6, label=name if ax is top else None)
    top.set_ylabel("MB")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("seconds since start")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    top.set_title("Stream lag during a full snapshot")
    save_figure(fig, "lag.png")


if __name__ == "__main__":
    sys.exit(main())
