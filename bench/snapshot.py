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
   mirror. The time of this write is the least any snapshot that lands its rows in such a table through Spark's
   Delta writer can take here. Ours no longer does for a chunk no change touched (its staged files are landed whole,
   ``cdc_assets.lake.adopt``), so for ours this is the bound of the way it took before, not of the way it takes now.
5. ``spark_jdbc``: what a Spark user writes instead of ours: ``spark.read.jdbc`` of the table partitioned on its key
   (``numPartitions`` = the master's cores, bounds from a ``min``/``max`` query, ``fetchsize`` 10000 so that a
   partition is not read into memory whole), then ``.write.format("delta")`` into a fresh directory; wall time
   from the process's start, Spark's start included. Then, untimed, the same read of ``bench_snap_odd_values``
   (numeric ``NaN``, a numeric of 45 digits, dates and timestamps at +-infinity, one column each), printing what the
   peer returns or the error it raises for each: the values our codec keeps exactly. Its JVM starts without our
   class archive (``cdc_assets.lake.class_archive``: a Spark user's JVM has none) unless ``--peer-class-archive``.
6. ``ours_cluster``: ours again with ``spark.master`` on a standalone cluster the command starts on loopback
   (``tools/spark_standalone.py``: ``--cluster-workers`` workers of one core and ``--cluster-worker-memory`` each),
   the driver in the worker process as for ``ours``. The executors' CPU (their JVMs, their Python workers) is
   sampled from the workers' process trees and added to the ``cpu jvm`` / ``cpu pyw`` columns.

dlt and ours run in their own Python process each (clean peak RSS). Reported per tool: wall seconds, rows/s, CPU
seconds of the client driver (Python or psql), of the Spark JVM and of Spark's Python workers, CPU seconds of the
PostgreSQL backends serving the reads, peak RSS of driver / JVM / Python workers (sampled every 0.2 s with psutil
in a thread; the driver's own peak from ``getrusage``), and the output size; then the ratios ours/copy and
ours/dlt (of wall seconds and of total client CPU seconds). Every result is checked: the row count in the dlt Delta
table and in our mirror must equal N.

``--tools`` picks and orders the steps (default ``copy,dlt,ours``; the bench extra's jars are needed for
``spark_jdbc``: ``EXTRAS=bench scripts/setup.sh``).

Output: the results table on stdout, ``bench/out/snapshot-<utc>.json``, ``bench/out/snapshot_rates.png`` (rows/s
per tool and size), ``bench/out/snapshot_rss_<N>.png`` (RSS over time of dlt and ours) and, for several sizes,
``bench/out/snapshot_driver_rss.png``.
"""

from __future__ import annotations

import argparse
import os
import re
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
    grant_select,
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
from tools.spark_standalone import standalone_cluster

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

    config = pipeline_config(
        SOURCE, lake, [args.table], chunk_size=args.chunk_size, spark_master=args.master, spark_conf=cluster_conf(args)
    )
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
        "tool": "ours" if args.master.startswith("local") else "ours_cluster",
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


def cluster_conf(args: argparse.Namespace) -> dict[str, str]:
    """The driver's settings on a standalone master (none for ``local[...]``): one core per executor, the executors'
    memory, every address on loopback."""
    if args.master.startswith("local"):
        return {}
    return {
        "spark.executor.cores": "1",
        "spark.executor.memory": args.cluster_executor_memory,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
    }


def bench_jars() -> list[str]:
    """The bench extra's jars (``jvm/bench/pom.xml``), fetched into ``.jars/bench/`` by ``EXTRAS=bench
    scripts/setup.sh``."""
    from cdc_assets.lake.spark import ROOT as PROJECT_ROOT

    folder = Path(os.environ.get("CDC_JARS_DIR", PROJECT_ROOT / ".jars")) / "bench"
    jars = sorted(str(p) for p in folder.glob("*.jar"))
    if not any("postgresql" in Path(j).name for j in jars):
        raise RuntimeError(f"no PostgreSQL JDBC driver in {folder}: run EXTRAS=bench scripts/setup.sh")
    return jars


ODD_VALUES_TABLE = "bench_snap_odd_values"
ODD_VALUES_SQL = f"""
drop table if exists {ODD_VALUES_TABLE};
create table {ODD_VALUES_TABLE} (id bigint primary key, nan numeric, wide numeric, day date, at timestamptz);
insert into {ODD_VALUES_TABLE} values
    (1, 'NaN', 123456789012345678901234567890.123456789012345, 'infinity', 'infinity'),
    (2, 1.5, 0.000000000000000000001, '-infinity', '-infinity'),
    (3, 2.5, 1, '2024-02-29', '2024-02-29 12:00:00.123456+00');
"""


def jdbc_source() -> tuple[str, dict[str, str]]:
    url = f"jdbc:postgresql://127.0.0.1:{pg_port()}/{DATABASE}"
    properties = {"user": READER, "password": reader_password(), "driver": "org.postgresql.Driver"}
    return url, {**properties, "fetchsize": "10000"}


def first_cause(text: str) -> str:
    """The cause of a Py4J error: its first ``Caused by:`` exception line, else its first exception line (the text's
    first line says only which call failed)."""
    lines = [line.strip().removeprefix(": ") for line in text.strip().splitlines() if line.strip()]
    exception = re.compile(r"^[\w.$]+(Exception|Error): ")
    causes = [line.removeprefix("Caused by: ") for line in lines if line.startswith("Caused by: ")]
    found = causes or [line for line in lines if exception.match(line)] or lines
    return found[0][:240]


def worker_spark_jdbc(args: argparse.Namespace) -> dict[str, Any]:
    """Step 5 of the module docstring: the Spark user's snapshot, then the odd values' read."""
    out = Path(args.out)
    sampler = Sampler(os.getpid()).start()
    started = time.monotonic()
    from cdc_assets.config import SparkConfig
    from cdc_assets.lake.spark import delta_jars, spark_session

    password = reader_password()
    try:
        spark = spark_session(
            SparkConfig(master=args.master, conf={"spark.jars": ",".join([*delta_jars(), *bench_jars()])}),
            use_class_archive=args.peer_class_archive,
        )
        spark_start = time.monotonic() - started
        url, properties = jdbc_source()
        bounds = spark.read.jdbc(
            url, f"(select min(id) as lo, max(id) as hi from public.{args.table}) as bounds", properties=properties
        ).first()
        partitions = spark.sparkContext.defaultParallelism
        frame = spark.read.jdbc(
            url, f"public.{args.table}", column="id", lowerBound=bounds["lo"], upperBound=bounds["hi"] + 1,
            numPartitions=partitions, properties=properties,
        )  # fmt: skip
        target = str(out / "lake")
        frame.write.format("delta").save(target)
        seconds = time.monotonic() - started
        usage = sampler.finish()
        rows = spark.read.format("delta").load(target).count()
        odd_values = {}
        for column in ("nan", "wide", "day", "at"):
            query = f"(select id, {column} from public.{ODD_VALUES_TABLE} order by id) as odd"
            try:
                found = spark.read.jdbc(url, query, properties=properties).orderBy("id").collect()
                odd_values[column] = [str(row[column]) for row in found]
            except Exception as error:  # the peer's own error is the finding
                odd_values[column] = "error: " + first_cause(str(error).replace(password, "***"))
        spark.stop()
    except Exception as error:  # never let the password reach the log
        raise RuntimeError(str(error).replace(password, "***")) from None
    return {
        "tool": "spark_jdbc",
        "rows": rows,
        "seconds": seconds,
        "usage": usage_json(usage),
        "output_mb": round(dir_size(out / "lake") / MB, 1),
        "partitions": partitions,
        "phases": {"spark_start": round(spark_start, 2)},
        "odd_values": odd_values,
        "series": _series(sampler),
    }


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


CLIENT_ROLES = ("driver", "jvm", "py_workers", "cluster_jvm", "cluster_pyw")


def client_cpu(result: dict[str, Any]) -> float:
    return sum(result["usage"].get(role, {}).get("cpu_seconds", 0.0) for role in CLIENT_ROLES)


def cluster_usage(usages: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The standalone workers' process trees (``Sampler`` rooted at each worker's JVM) as two roles: ``cluster_jvm``
    (the workers' and their executors' JVMs) and ``cluster_pyw`` (the executors' Python workers). A peak RSS is the
    sum of each tree's peak: an upper bound (the trees were sampled apart)."""
    merged: dict[str, dict[str, float]] = {}
    for usage in usages:
        for role, item in usage_json(usage).items():
            name = {"driver": "cluster_jvm", "jvm": "cluster_jvm", "py_workers": "cluster_pyw"}.get(role)
            if name is None:
                continue
            into = merged.setdefault(name, {"peak_rss_mb": 0.0, "cpu_seconds": 0.0, "processes": 0})
            for key in into:
                into[key] = round(into[key] + item[key], 2)
    return merged


def run_ours(table: str, rows: int, args: argparse.Namespace, tool: str) -> dict[str, Any]:
    """``ours`` on ``local[2]``, or ``ours_cluster`` on a standalone cluster started for it."""
    out = fresh_dir(f"lake-{tool}-{rows}")
    with admin_connect() as conn:
        reset_capture(conn, SOURCE, [table])
    worker_args = ["--worker", "ours", "--table", table, "--out", str(out), "--chunk-size", str(args.chunk_size),
                   "--chunks-per-call", str(args.chunks_per_call),
                   "--cluster-executor-memory", args.cluster_executor_memory]  # fmt: skip
    try:
        if tool == "ours":
            return run_worker("bench.snapshot", worker_args, f"snapshot-ours-{rows}")
        work = fresh_dir(f"cluster-{rows}")
        try:
            with standalone_cluster(
                work, workers=args.cluster_workers, cores=1, memory=args.cluster_worker_memory
            ) as cluster:
                samplers = [Sampler(pid, pg_users=(), lifetime_peak=False).start() for pid in cluster.worker_pids]
                worker_args += ["--master", cluster.master]
                result = run_worker("bench.snapshot", worker_args, f"snapshot-{tool}-{rows}")
                result["usage"] |= cluster_usage([sampler.finish() for sampler in samplers])
                result["master"] = cluster.master
                result["workers"] = f"{args.cluster_workers} x 1 core, {args.cluster_worker_memory}"
                return result
        finally:
            if not args.keep:
                remove_dir(work)
    finally:
        with admin_connect() as conn:
            drop_capture(conn, SOURCE)
        if not args.keep:
            remove_dir(out)


def run_spark_jdbc(table: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    out = fresh_dir(f"spark-jdbc-{rows}")
    with admin_connect() as conn:
        conn.execute(ODD_VALUES_SQL)
        grant_select(conn, ODD_VALUES_TABLE)
    try:
        archive = ["--peer-class-archive"] if args.peer_class_archive else []
        return run_worker("bench.snapshot", ["--worker", "spark_jdbc", "--table", table, "--out", str(out), *archive],
                          f"snapshot-spark-jdbc-{rows}")  # fmt: skip
    finally:
        if not args.keep:
            remove_dir(out)


TOOLS = ("copy", "dlt", "spark_jdbc", "ours", "ours_cluster")


def run_size(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    table = table_name(rows)
    started = time.monotonic()
    built = ensure_table(table, rows, force=args.rebuild)
    build_seconds = time.monotonic() - started
    print(f"[snapshot] table {table}: {'built' if built else 'reused'} ({build_seconds:.1f} s); "
          f"warm-up scan {warm_up(table):.1f} s", flush=True)  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for tool in [t.strip() for t in args.tools.split(",") if t.strip()]:
        if tool == "copy":
            results["copy"] = run_copy(table)
            results["copy"]["rows"] = rows
        elif tool == "dlt":
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
        elif tool == "spark_jdbc":
            results[tool] = run_spark_jdbc(table, rows, args)
        elif tool in ("ours", "ours_cluster"):
            results[tool] = run_ours(table, rows, args, tool)
        else:
            raise SystemExit(f"--tools: unknown tool {tool!r}; allowed: {', '.join(TOOLS)}")
        print(f"[snapshot] {tool}: {results[tool]['seconds']:.1f} s {results[tool].get('phases', '')}", flush=True)
    for name, result in results.items():
        if result["rows"] != rows:
            raise RuntimeError(f"{name} produced {result['rows']} rows, expected {rows}")
    ratios = {}
    for ours in ("ours", "ours_cluster"):
        if ours in results:
            for other in ("copy", "dlt", "spark_jdbc", "ours"):
                if other in results and other != ours:
                    ratios[f"{ours}/{other} seconds"] = results[ours]["seconds"] / results[other]["seconds"]
                    cpu = client_cpu(results[ours]) / max(client_cpu(results[other]), 1e-9)
                    ratios[f"{ours}/{other} client cpu"] = cpu
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

            def total(*roles: str, key: str = "cpu_seconds") -> float | None:
                values = [value for role in roles if (value := get(role, key)) is not None]
                return sum(values) if values else None

            cpu = [get("driver", "cpu_seconds"), total("jvm", "cluster_jvm"), total("py_workers", "cluster_pyw"),
                   get("pg_backends", "cpu_seconds")]  # fmt: skip
            rss = [get(role, "peak_rss_mb") for role in ("driver", "jvm", "py_workers")]
            lines.append([run["rows"], tool, r["seconds"], run["rows"] / r["seconds"], *cpu, *rss, r["output_mb"]])
    print()
    print_table(f"Snapshot benchmark ({machine()}; chunk_size {args.chunk_size}, {args.chunks_per_call} chunks/call)",
                header, lines)  # fmt: skip
    print("  (ours_cluster: cpu jvm and cpu pyw include the standalone workers' and executors' processes; the rss "
          "columns are the driver's process tree only)")  # fmt: skip
    for run in runs:
        results = run["results"]
        for name, value in run["ratios"].items():
            print(f"  {run['rows']:>12,} rows  {name:<28} {value:6.2f}x")
        for tool in ("ours", "ours_cluster"):
            ours = results.get(tool)
            if not ours:
                continue
            where = f" on {ours['master']} ({ours['workers']})" if "master" in ours else ""
            print(f"  {run['rows']:>12,} rows  {tool}{where} phases (s): {ours['phases']}  chunks: {ours['chunks']}, "
                  f"stream batches: {len(ours['stream_batches'])}")  # fmt: skip
            python, jvm = ours["usage"].get("cluster_pyw"), ours["usage"].get("cluster_jvm")
            if python and jvm:
                print(f"  {run['rows']:>12,} rows  {tool} executors: Python workers {python['cpu_seconds']} CPU s, "
                      f"JVMs {jvm['cpu_seconds']} CPU s (peak RSS at most {jvm['peak_rss_mb']:,.0f} + "
                      f"{python['peak_rss_mb']:,.0f} MB)")  # fmt: skip
            floor = ours["floor"]
            line = (f"  {run['rows']:>12,} rows  {tool} floor, Spark + Delta alone (warm JVM): read "
                    f"{floor['read_seconds']} s, read + write as a new mirror {floor['read_write_seconds']} s "
                    f"({run['rows'] / floor['read_write_seconds']:,.0f} rows/s, driver JVM CPU "
                    f"{floor.get('read_write_jvm_cpu')} s)")  # fmt: skip
            print(line)
            for other, target in (("spark_jdbc", 1.0), ("dlt", 1.0), ("copy", None)):
                if other in results:
                    speed = results[other]["seconds"] / ours["seconds"]
                    best = results[other]["seconds"] / floor["read_write_seconds"]
                    goal = f" (target >= {target}x)" if target else ""
                    print(f"  {run['rows']:>12,} rows  {tool} speed against {other} (its seconds / ours): {speed:.2f}x"
                          f"{goal}; highest reachable by a rewrite through Spark (floor): {best:.2f}x")  # fmt: skip
        peer = results.get("spark_jdbc")
        if peer:
            print(f"  {run['rows']:>12,} rows  spark_jdbc: {peer['partitions']} partitions, Spark start "
                  f"{peer['phases']['spark_start']} s; on {ODD_VALUES_TABLE} (rows 1, 2, 3):")  # fmt: skip
            for column, found in peer["odd_values"].items():
                print(f"      {column}: {found}")
    plot(runs)


def plot(runs: list[dict[str, Any]]) -> None:
    plt = pyplot()
    tools = [t for t in TOOLS if any(t in run["results"] for run in runs)]
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
        for tool in ("dlt", "spark_jdbc", "ours", "ours_cluster"):
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
    parser.add_argument("--tools", default="copy,dlt,ours", help=f"in this order, of: {','.join(TOOLS)}")
    parser.add_argument("--chunk-size", type=int, default=250_000, help="our chunk size in rows (default 250000)")
    parser.add_argument("--chunks-per-call", type=int, default=4, help="chunks per snapshot call (Dagster: 4)")
    parser.add_argument("--dlt-return-type", default="arrow", choices=["arrow", "arrow_stream"])
    parser.add_argument("--rebuild", action="store_true", help="rebuild the table even when it exists")
    parser.add_argument("--prepare-only", action="store_true", help="only build the table(s), measure nothing")
    parser.add_argument("--keep", action="store_true", help="keep the dlt output and our lake under bench/out/work")
    parser.add_argument("--cluster-workers", type=int, default=2, help="ours_cluster: standalone workers (1 core each)")
    parser.add_argument("--cluster-worker-memory", default="4g", help="ours_cluster: each worker's memory (4g)")
    parser.add_argument("--cluster-executor-memory", default="3g", help="ours_cluster: spark.executor.memory (3g)")
    parser.add_argument(
        "--peer-class-archive", action="store_true", help="spark_jdbc: start its JVM with our class archive too"
    )
    parser.add_argument("--worker", choices=["dlt", "ours", "spark_jdbc"], help=argparse.SUPPRESS)
    parser.add_argument("--master", default="local[2]", help=argparse.SUPPRESS)
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
    if args.worker == "spark_jdbc":
        from bench.common import emit_result

        emit_result(worker_spark_jdbc(args))
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
