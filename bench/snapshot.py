"""Benchmark 1: full snapshot of one wide table, three ways, measured in the same run.

    .venv/bin/python -m bench.snapshot --rows 10000000            # the full form
    .venv/bin/python -m bench.snapshot --rows 1000000,10000000    # driver RSS at 1M vs 10M rows
    .venv/bin/python -m bench.snapshot --rows 10000000 --prepare-only   # build the table beforehand (~2 min)

For each size N (table ``bench_snap_<N>``: N rows, 10 columns of mixed types, bigint primary key; built once and
reused) it measures, one after the other, after one untimed warm-up scan of the table:

1. ``copy``: ``psql -c "\\copy (select * from t) to /dev/null"`` as the read-only role over TCP: the floor.
2. ``dlt``: ``dlt.sources.sql_database.sql_table(backend="connectorx")`` into the ``filesystem`` destination with
   ``table_format="delta"`` in a fresh local directory (dlt 1.31: extract, normalize, load; the connectorx backend
   reads the whole table into one Arrow table unless ``--dlt-return-type arrow_stream``).
3. ``ours``: ``cdc_assets.sources.postgres.pipeline`` in a fresh lake: Spark start-up, prepare, chunk plan, every chunk
   snapshotted (``--chunks-per-call`` chunks per ``snapshot`` call, as a Dagster run of the table asset does), then
   stream batches until every staged chunk is reconciled into the mirror (``waiting_windows == 0``).
4. ``floor`` (in ours' process, after it): Spark and Delta alone on the same rows, no database: the mirror read
   (a hash of every column summed), and the mirror read and written again as a new Delta table made like the
   mirror. The time of this write is the least any snapshot that lands its rows in such a table through Spark can
   take here, so ``copy`` seconds / floor seconds is the highest ours/copy ratio reachable on this machine.

dlt and ours run in their own Python process each (clean peak RSS). Reported per tool: wall seconds, rows/s, CPU
seconds of the client driver (Python or psql), of the Spark JVM and of Spark's Python workers, CPU seconds of the
PostgreSQL backends serving the reads, peak RSS of driver / JVM / Python workers (sampled every 0.2 s with psutil
in a thread; the driver's own peak from ``getrusage``), and the output size; then the ratios ours/copy and
ours/dlt (of wall seconds and of total client CPU seconds). Every result is checked: the row count in the dlt Delta
table and in our mirror must equal N.

Output: the results table on stdout, ``bench/out/snapshot-<utc>.json``, ``bench/out/snapshot_rates.png`` (rows/s
per tool and size), ``bench/out/snapshot_rss_<N>.png`` (RSS over time of dlt and ours) and, for several sizes,
``bench/out/snapshot_driver_rss.png``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    DATABASE,
    MB,
    READER,
    Sampler,
    admin_connect,
    dir_size,
    drop_capture,
    ensure_database,
    fresh_dir,
    machine,
    pg_port,
    pipeline_config,
    print_table,
    pyplot,
    reader_password,
    remove_dir,
    reset_capture,
    run_worker,
    save_figure,
    save_json,
    usage_json,
)
from bench.datagen import COLUMNS, ensure_table

SOURCE = "bench_snap"
SERIES_POINTS = 400


def table_name(rows: int) -> str:
    return f"bench_snap_{rows}"


# ---------------------------------------------------------------------------------------------------------------
# workers (own process each)


def _series(sampler: Sampler) -> dict[str, list[float]]:
    step = max(1, len(sampler.series) // SERIES_POINTS)
    points = sampler.series[::step]
    return {
        "t": [round(t, 2) for t, _ in points],
        **{role: [round(v.get(role, 0) / MB, 1) for _, v in points] for role in ("driver", "jvm", "py_workers")},
    }


def worker_dlt(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    sampler = Sampler(os.getpid()).start()
    started = time.monotonic()
    import dlt
    from dlt.sources.sql_database import sql_table

    password = reader_password()
    url = f"postgresql+psycopg://{READER}:{password}@127.0.0.1:{pg_port()}/{DATABASE}"
    backend_kwargs: dict[str, Any] = {}
    if args.dlt_return_type != "arrow":
        backend_kwargs["return_type"] = args.dlt_return_type
    try:
        resource = sql_table(
            credentials=url, table=args.table, schema="public", backend="connectorx", backend_kwargs=backend_kwargs
        )
        pipeline = dlt.pipeline(
            pipeline_name="bench_snapshot",
            pipelines_dir=str(out / "pipelines"),
            destination=dlt.destinations.filesystem(bucket_url=str(out / "lake")),
            dataset_name="bench",
        )
        info = pipeline.run(resource, table_format="delta")
    except Exception as error:  # never let the URL's password reach the log
        raise RuntimeError(str(error).replace(password, "***")) from None
    seconds = time.monotonic() - started
    usage = sampler.finish()
    from deltalake import DeltaTable

    delta_path = out / "lake" / "bench" / args.table
    rows = DeltaTable(str(delta_path)).to_pyarrow_dataset().count_rows()
    return {
        "tool": "dlt",
        "rows": rows,
        "seconds": seconds,
        "usage": usage_json(usage),
        "output_mb": round(dir_size(delta_path) / MB, 1),
        "loads": len(info.loads_ids),
        "series": _series(sampler),
    }


def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    lake = Path(args.out)
    sampler = Sampler(os.getpid()).start()
    started = time.monotonic()
    from cdc_assets.lake.spark import spark_session
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline

    config = pipeline_config(SOURCE, lake, [args.table], chunk_size=args.chunk_size)
    phases: dict[str, float] = {}
    mark = time.monotonic()
    spark = spark_session(config.spark)
    phases["spark_start"] = time.monotonic() - mark
    mark = time.monotonic()
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()[f"public.{args.table}"]
    plan = pipeline.plan(table)
    phases["prepare_plan"] = time.monotonic() - mark
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    indexes = [c.index for c in plan.chunks]
    calls = []
    mark = time.monotonic()
    for start in range(0, len(indexes), args.chunks_per_call):
        group = indexes[start : start + args.chunks_per_call]
        report = pipeline.snapshot(spark, table, group, run_id)
        calls.append({"t": round(time.monotonic() - started, 2), "chunks": len(group), "rows": report.rows,
                      "seconds": round(report.seconds, 2)})  # fmt: skip
    phases["snapshot"] = time.monotonic() - mark
    mark = time.monotonic()
    batches = []
    recorded = None
    while True:
        report = pipeline.stream_batch(spark, recorded, run_id)
        recorded = report.offset
        pipeline.acknowledge(recorded)
        batches.append({"changes": report.changes, "reconciled": len(report.reconciled),
                        "waiting": report.waiting_windows, "seconds": round(report.seconds, 2)})  # fmt: skip
        if report.waiting_windows == 0:
            break
        if len(batches) > 1000:
            raise RuntimeError("staged chunks still waiting after 1000 stream batches")
    phases["reconcile"] = time.monotonic() - mark
    seconds = time.monotonic() - started
    usage = sampler.finish()
    mirror = pipeline.lake.table(table.qualified_name).mirror
    rows = spark.read.format("delta").load(mirror).count()
    floor = spark_delta_floor(spark, mirror, lake / "floor", list(table.columns))
    spark.stop()
    return {
        "tool": "ours",
        "rows": rows,
        "seconds": seconds,
        "usage": usage_json(usage),
        "output_mb": round(dir_size(Path(mirror)) / MB, 1),
        "chunks": len(indexes),
        "snapshot_calls": calls,
        "stream_batches": batches,
        "phases": {k: round(v, 2) for k, v in phases.items()},
        "floor": floor,
        "series": _series(sampler),
    }


def spark_delta_floor(spark: Any, mirror: str, target: Path, columns: list[Any]) -> dict[str, float]:
    """Step 4 of the module docstring: the mirror's rows read by Spark (every column hashed), then read and written
    again by Spark into a new Delta table made like the mirror (``ensure_mirror``: Change Data Feed, deletion vectors,
    statistics on every column), after our snapshot in the same warm JVM."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import MapType

    from cdc_assets.lake.mirror import ensure_mirror
    from cdc_assets.sources.postgres.pg_values import spark_schema

    rows = spark.read.format("delta").load(mirror)
    maps = [f.name for f in rows.schema.fields if isinstance(f.dataType, MapType)]  # hash() refuses maps
    every_column = [F.sum(F.hash(*[c for c in rows.columns if c not in maps])), *[F.sum(F.size(m)) for m in maps]]
    started = time.monotonic()
    rows.select(*every_column).first()  # the noop writer refuses deletion-vector tables
    read_seconds = time.monotonic() - started
    sampler = Sampler(os.getpid(), lifetime_peak=False).start()
    started = time.monotonic()
    ensure_mirror(spark, str(target), spark_schema(columns).fields)
    rows.write.format("delta").mode("append").save(str(target))
    write_seconds = time.monotonic() - started
    jvm_cpu = sampler.finish()["jvm"].cpu_seconds
    remove_dir(target)
    return {"read_seconds": round(read_seconds, 2), "read_write_seconds": round(write_seconds, 2),
            "read_write_jvm_cpu": round(jvm_cpu, 1)}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# parent


def run_copy(table: str) -> dict[str, Any]:
    """``psql \\copy`` of the whole table to /dev/null, sampled from here (psql is the root of the tree)."""
    command = ["psql", "-X", "-q", "-h", "127.0.0.1", "-p", str(pg_port()), "-U", READER, "-d", DATABASE,
               "-v", "ON_ERROR_STOP=1", "-c", f"\\copy (select * from public.{table}) to /dev/null"]  # fmt: skip
    env = {**os.environ, "PGPASSWORD": reader_password()}
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(process.pid, interval=0.1).start()
    _, stderr = process.communicate()
    seconds = time.monotonic() - started
    usage = sampler.finish()
    if process.returncode != 0:
        raise RuntimeError(f"psql \\copy failed: {stderr.strip()}")
    return {"tool": "copy", "rows": None, "seconds": seconds, "usage": usage_json(usage), "output_mb": None}


def warm_up(table: str) -> float:
    started = time.monotonic()
    with admin_connect() as conn:
        conn.execute(f"select count(*), sum(length(note)) from public.{table}").fetchone()
    return time.monotonic() - started


def client_cpu(result: dict[str, Any]) -> float:
    return sum(result["usage"].get(role, {}).get("cpu_seconds", 0.0) for role in ("driver", "jvm", "py_workers"))


def run_size(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    table = table_name(rows)
    started = time.monotonic()
    built = ensure_table(table, rows, force=args.rebuild)
    build_seconds = time.monotonic() - started
    print(f"[snapshot] table {table}: {'built' if built else 'reused'} ({build_seconds:.1f} s); "
          f"warm-up scan {warm_up(table):.1f} s", flush=True)  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if "copy" in tools:
        results["copy"] = run_copy(table)
        results["copy"]["rows"] = rows
        print(f"[snapshot] copy: {results['copy']['seconds']:.1f} s", flush=True)
    if "dlt" in tools:
        out = fresh_dir(f"dlt-{rows}")
        try:
            results["dlt"] = run_worker(
                "bench.snapshot",
                ["--worker", "dlt", "--table", table, "--out", str(out), "--dlt-return-type", args.dlt_return_type],
                f"snapshot-dlt-{rows}",
                env={"RUNTIME__DLTHUB_TELEMETRY": "false", "DLT_DATA_DIR": str(out / "dlt_data")},
            )
        finally:
            if not args.keep:
                remove_dir(out)
        print(f"[snapshot] dlt: {results['dlt']['seconds']:.1f} s", flush=True)
    if "ours" in tools:
        out = fresh_dir(f"lake-{rows}")
        with admin_connect() as conn:
            reset_capture(conn, SOURCE, [table])
        try:
            results["ours"] = run_worker(
                "bench.snapshot",
                ["--worker", "ours", "--table", table, "--out", str(out), "--chunk-size", str(args.chunk_size),
                 "--chunks-per-call", str(args.chunks_per_call)],
                f"snapshot-ours-{rows}",
            )  # fmt: skip
        finally:
            with admin_connect() as conn:
                drop_capture(conn, SOURCE)
            if not args.keep:
                remove_dir(out)
        print(f"[snapshot] ours: {results['ours']['seconds']:.1f} s {results['ours']['phases']}", flush=True)
    for name, result in results.items():
        if result["rows"] != rows:
            raise RuntimeError(f"{name} produced {result['rows']} rows, expected {rows}")
    ratios = {}
    if "ours" in results:
        for other in ("copy", "dlt"):
            if other in results:
                ratios[f"ours/{other} seconds"] = results["ours"]["seconds"] / results[other]["seconds"]
                ratios[f"ours/{other} client cpu"] = client_cpu(results["ours"]) / max(client_cpu(results[other]), 1e-9)
    return {"rows": rows, "table": table, "columns": COLUMNS, "built": built, "results": results, "ratios": ratios}


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    header = ["rows", "tool", "seconds", "rows/s", "cpu drv", "cpu jvm", "cpu pyw", "cpu pg", "rss drv MB",
              "rss jvm MB", "rss pyw MB", "out MB"]  # fmt: skip
    lines = []
    for run in runs:
        for tool, r in run["results"].items():
            u = r["usage"]

            def get(role: str, key: str, usage: dict[str, Any] = u) -> float | None:
                return usage.get(role, {}).get(key)

            cpu = [get(role, "cpu_seconds") for role in ("driver", "jvm", "py_workers", "pg_backends")]
            rss = [get(role, "peak_rss_mb") for role in ("driver", "jvm", "py_workers")]
            lines.append([run["rows"], tool, r["seconds"], run["rows"] / r["seconds"], *cpu, *rss, r["output_mb"]])
    print()
    print_table(f"Snapshot benchmark ({machine()}; chunk_size {args.chunk_size}, {args.chunks_per_call} chunks/call)",
                header, lines)  # fmt: skip
    for run in runs:
        for name, value in run["ratios"].items():
            print(f"  {run['rows']:>12,} rows  {name:<24} {value:6.2f}x")
        ours = run["results"].get("ours")
        if ours:
            print(f"  {run['rows']:>12,} rows  ours phases (s): {ours['phases']}  chunks: {ours['chunks']}, "
                  f"stream batches: {len(ours['stream_batches'])}")  # fmt: skip
            floor = ours["floor"]
            line = (f"  {run['rows']:>12,} rows  floor, Spark + Delta alone (warm JVM): read {floor['read_seconds']} s,"
                    f" read + write as a new mirror {floor['read_write_seconds']} s "
                    f"({run['rows'] / floor['read_write_seconds']:,.0f} rows/s, JVM CPU "
                    f"{floor.get('read_write_jvm_cpu')} s)")  # fmt: skip
            for other, target in (("copy", 0.5), ("dlt", 1.5)):
                if other in run["results"]:
                    best = run["results"][other]["seconds"] / floor["read_write_seconds"]
                    line += f"; highest ours/{other} reachable {best:.2f}x (target {target}x)"
            print(line)
    plot(runs)


def plot(runs: list[dict[str, Any]]) -> None:
    plt = pyplot()
    tools = ["copy", "dlt", "ours"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        values = [run["rows"] / run["results"][t]["seconds"] if t in run["results"] else 0 for t in tools]
        ax.bar([x + i * width for x in range(len(tools))], values, width, label=f"{run['rows']:,} rows")
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(tools))], tools)
    ax.set_ylabel("rows/s")
    ax.set_title("Full snapshot throughput")
    ax.legend()
    save_figure(fig, "snapshot_rates.png")
    for run in runs:
        fig, ax = plt.subplots(figsize=(8, 4))
        for tool in ("dlt", "ours"):
            series = run["results"].get(tool, {}).get("series")
            if not series:
                continue
            for role, style in (("driver", "-"), ("jvm", "--"), ("py_workers", ":")):
                if any(series[role]):
                    ax.plot(series["t"], series[role], style, label=f"{tool} {role}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS MB")
        ax.set_title(f"Memory during the snapshot of {run['rows']:,} rows")
        ax.legend(fontsize=8)
        save_figure(fig, f"snapshot_rss_{run['rows']}.png")
    if len(runs) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for tool in ("dlt", "ours"):
            xs = [r["rows"] for r in runs if tool in r["results"]]
            ys = [
                r["results"][tool]["usage"].get("driver", {}).get("peak_rss_mb", 0)
                for r in runs
                if tool in r["results"]
            ]
            if xs:
                ax.plot(xs, ys, "o-", label=f"{tool} driver")
        ax.set_xscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("peak driver RSS MB")
        ax.legend()
        save_figure(fig, "snapshot_driver_rss.png")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10000000", help="table size, or several comma-separated (default 10M)")
    parser.add_argument("--tools", default="copy,dlt,ours", help="subset of copy,dlt,ours")
    parser.add_argument("--chunk-size", type=int, default=250_000, help="our chunk size in rows (default 250000)")
    parser.add_argument("--chunks-per-call", type=int, default=4, help="chunks per snapshot call (Dagster: 4)")
    parser.add_argument("--dlt-return-type", default="arrow", choices=["arrow", "arrow_stream"])
    parser.add_argument("--rebuild", action="store_true", help="rebuild the table even when it exists")
    parser.add_argument("--prepare-only", action="store_true", help="only build the table(s), measure nothing")
    parser.add_argument("--keep", action="store_true", help="keep the dlt output and our lake under bench/out/work")
    parser.add_argument("--worker", choices=["dlt", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "dlt":
        from bench.common import emit_result

        emit_result(worker_dlt(args))
        return 0
    if args.worker == "ours":
        from bench.common import emit_result

        emit_result(worker_ours(args))
        return 0
    ensure_database()
    sizes = [int(s.replace("_", "")) for s in args.rows.split(",") if s.strip()]
    if args.prepare_only:
        for rows in sizes:
            started = time.monotonic()
            built = ensure_table(table_name(rows), rows, force=args.rebuild)
            print(f"[snapshot] table {table_name(rows)}: {'built' if built else 'reused'} "
                  f"({time.monotonic() - started:.1f} s)")  # fmt: skip
        return 0
    runs = [run_size(rows, args) for rows in sizes]
    report(runs, args)
    path = save_json("snapshot", {"args": vars(args), "runs": runs})
    print(f"\nresults: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
