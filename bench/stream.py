"""Benchmark 2: streaming throughput, against the decoding rate of the same WAL (the limit).

    .venv/bin/python -m bench.stream --changes 1000000

Steps, in one process (its Spark driver is started once, as a long-lived driver would be; with Dagster every batch
run starts its own, see ``bench.freshness``):

1. Table ``bench_stream`` (``--initial-rows`` rows, the snapshot table's 10 columns), publication and pgoutput slot
   ``bench_stream`` created by the administrator; our pipeline snapshots it and streams until every chunk is
   reconciled, so the mirror holds the initial rows (not timed beyond being reported).
2. Workload: ``--changes`` changes in transactions of ``--tx-size``, of the ``--mix`` (``update-heavy``, the
   default: 3 inserts, 2 deletes and 5 updates per 10 changes; ``insert-heavy``: 9 inserts and 1 update per 10;
   ``bench.datagen.MIXES``), committed by a server-side procedure as fast as it goes; the WAL it wrote is reported.
3. Decode limit: ``select count(*) from pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1',
   'publication_names', pub)`` on the same slot (peek does not consume), as the read-only role, ``--decode-repeats``
   times; changes/s = workload changes / seconds. Also ``peek+fetch``: the same peek's rows fetched by the client
   through a server-side cursor (5000 rows per fetch, as our batches read), not decoded.
4. Ours: ``stream_batch`` + ``acknowledge`` back to back (the source's ``max_changes`` bound per batch) until the
   slot reaches the end of the workload's WAL; changes/s applied into the mirror, per batch and overall, with the
   batches' phase seconds (read = peek + fetch + pgoutput decode + spill; changelog; merge; reconcile), CPU seconds and
   peak RSS of driver, JVM and Python workers. Checked afterwards: the mirror's row count, sum(id) and sum(amount)
   equal the source's.
5. Floor, Spark and Delta alone on the same batches: a copy of the mirror as it was before step 4 (Delta ``RESTORE``
   of its version then), and for each of our batches, its changes taken from our changelog: their append to a fresh
   Delta changelog, then the MERGE of their net change per key (precomputed and materialized beforehand, untimed)
   with the pipeline's own statement (``merge_net_changes``), under the session settings ``apply_changes`` takes for
   the copy's size (``merge_write_conf``) and, where it would (``takes_two_statements``), as its two statements. No slot
   read, no decode, no net-change computation, and a JVM already warmed by step 4: what Spark and Delta alone take
   for these batches on this machine, an upper bound of our rate. Checked: the copy's count and sums equal our
   mirror's. Steps 5 and 6 run ``--warm-rounds`` times (default 2), the last round reported: a JVM that had run step
   4 alone still spent 21.9 s of its JIT compilers' time in the floor's timed statements (2026-12-07), and ours, run
   after it, was then faster than the floor.
6. Ours again, warm (``warm_replay``): the same batches through the pipeline's own ``append_changelog`` and
   ``apply_changes``, taken from our changelog, on another copy of the mirror as it was before step 4, after the
   floor. The difference to step 4's changelog and merge phases is the JVM's warm-up (the driver JVM's JIT
   compilers' and collectors' seconds are recorded per batch in steps 4, 5 and 6); the difference to the floor is
   what the pipeline's statements add to Delta's. Checked: the copy's sums equal our mirror's.
7. Upkeep: ``maintain_lake`` once (both steps, what a stream run does at most every ``stream.compact_seconds`` and
   ``stream.vacuum_seconds``): its seconds and the
   mirror's and changelog's file counts before and after; the mirror's sums must not change.

Output: results table, ratio ours/decode-limit, ``bench/out/stream-<utc>.json``, ``bench/out/stream_batches.png``
(changes/s per batch against the decode limit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    MB,
    JvmClock,
    Sampler,
    admin_connect,
    drop_capture,
    ensure_database,
    fresh_dir,
    jvm_clock,
    machine,
    percentile,
    pipeline_config,
    print_table,
    pyplot,
    reader_dsn_kwargs,
    remove_dir,
    reset_capture,
    save_figure,
    save_json,
    usage_json,
)
from bench.datagen import MIXES, create_hot_table, install_workload, run_workload
from cdc_assets.config import StreamConfig
from cdc_assets.sources.postgres.snapshot import take_inserted_wal_end

SOURCE = "bench_stream"
TABLE = "bench_stream"
PEEK = "pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s)"


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def slot_lsn(conn: psycopg.Connection, slot: str) -> int:
    (value,) = conn.execute(
        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", [slot]
    ).fetchone()
    return lsn_int(value)


def flush_lsn(conn: psycopg.Connection) -> int:
    return lsn_int(conn.execute("select pg_current_wal_flush_lsn()::text").fetchone()[0])


def _pg_cpu(usage: dict[str, Any]) -> float | None:
    backends = usage.get("pg_backends")
    return None if backends is None else backends.cpu_seconds


def wait_flushed(conn: psycopg.Connection) -> int:
    """Wait until the WAL written so far is flushed (peek decodes only flushed WAL); returns that LSN (the end of
    the inserted WAL: the raw insert position past an empty page's header is never flushed while the server idles)."""
    target = take_inserted_wal_end(conn)
    while flush_lsn(conn) < target:
        time.sleep(0.05)
    return target


def decode_limit(repeats: int) -> list[dict[str, Any]]:
    """Time the server-side decode (count(*) over the peek), then peek + client fetch, as the reader role."""
    runs = []
    with psycopg.connect(**reader_dsn_kwargs(), autocommit=True) as conn:
        for i in range(repeats):
            sampler = Sampler(os.getpid(), interval=0.1, lifetime_peak=False).start()
            started = time.monotonic()
            (messages,) = conn.execute(f"select count(*) from {PEEK}", [SOURCE, SOURCE]).fetchone()
            seconds = time.monotonic() - started
            usage = sampler.finish()
            runs.append({"kind": "peek count(*)", "repeat": i, "messages": int(messages), "seconds": seconds,
                         "pg_cpu": _pg_cpu(usage)})  # fmt: skip
        sampler = Sampler(os.getpid(), interval=0.1, lifetime_peak=False).start()
        started = time.monotonic()
        rows = 0
        with conn.transaction(), conn.cursor(name="bench_peek", binary=True) as cursor:
            cursor.itersize = 5000
            cursor.execute(f"select data from {PEEK}", [SOURCE, SOURCE])
            for _ in cursor:
                rows += 1
        seconds = time.monotonic() - started
        usage = sampler.finish()
        runs.append({"kind": "peek+fetch", "repeat": 0, "messages": rows, "seconds": seconds, "pg_cpu": _pg_cpu(usage)})
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=1_000_000, help="workload changes (default 1M)")
    parser.add_argument("--tx-size", type=int, default=10, help="changes per transaction (default 10)")
    parser.add_argument("--mix", choices=sorted(MIXES), default="update-heavy", help="workload (default update-heavy)")
    parser.add_argument("--initial-rows", type=int, default=1_000_000, help="rows before the workload (default 1M)")
    parser.add_argument("--chunk-size", type=int, default=250_000)
    parser.add_argument(
        "--max-changes",
        type=int,
        default=StreamConfig.max_changes,
        help=f"our batch bound (source default {StreamConfig.max_changes})",
    )
    parser.add_argument("--decode-repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the lake under bench/out/work")
    parser.add_argument(
        "--warm-rounds", type=int, default=2,
        help="rounds of steps 5 and 6 (floor, then ours again), the last one reported (default 2: the first warms "
        "the JVM for both)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.warm_rounds < 1:
        parser.error(f"--warm-rounds must be 1 or more (the last round is reported), not {args.warm_rounds}")

    ensure_database()
    install_workload()
    create_hot_table(TABLE, args.initial_rows)
    lake = fresh_dir("stream")
    with admin_connect() as conn:
        reset_capture(conn, SOURCE, [TABLE])
    try:
        result = run(args, lake)
    finally:
        with admin_connect() as conn:
            drop_capture(conn, SOURCE)
        if not args.keep:
            remove_dir(lake)
    report(result, args)
    path = save_json("stream", {"args": vars(args), **result})
    print(f"\nresults: {path}", flush=True)
    return 0


def run(args: argparse.Namespace, lake: Path) -> dict[str, Any]:
    from cdc_assets.lake.spark import spark_session
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline

    config = pipeline_config(SOURCE, lake, [TABLE], chunk_size=args.chunk_size, max_changes=args.max_changes)
    started = time.monotonic()
    spark = spark_session(config.spark)
    spark_seconds = time.monotonic() - started
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()[f"public.{TABLE}"]
    run_id = f"bench-{uuid.uuid4().hex[:8]}"

    # 1. initial mirror
    started = time.monotonic()
    plan = pipeline.plan(table)
    indexes = [c.index for c in plan.chunks]
    for start in range(0, len(indexes), 4):
        pipeline.snapshot(spark, table, indexes[start : start + 4], run_id)
    recorded = None
    while True:
        report = pipeline.stream_batch(spark, recorded, run_id)
        recorded = report.offset
        pipeline.acknowledge(recorded)
        if report.waiting_windows == 0:
            break
    initial_seconds = time.monotonic() - started
    print(f"[stream] initial mirror: {args.initial_rows:,} rows in {initial_seconds:.1f} s", flush=True)

    # 2. workload
    with admin_connect() as conn:
        start_lsn = slot_lsn(conn, SOURCE)
        conn.execute("set synchronous_commit = on")
        started = time.monotonic()
        transactions = args.changes // args.tx_size
        changes = run_workload(conn, TABLE, transactions, args.tx_size, args.mix)
        end_lsn = wait_flushed(conn)
        workload_seconds = time.monotonic() - started
    wal = end_lsn - start_lsn
    print(f"[stream] workload: {changes:,} changes, {wal / MB:.1f} MB WAL in {workload_seconds:.1f} s", flush=True)

    # 3. decode limit (peek does not consume)
    decode = decode_limit(args.decode_repeats)
    for item in decode:
        print(f"[stream] {item['kind']}: {item['messages']:,} messages in {item['seconds']:.2f} s", flush=True)

    # 4. ours
    from delta.tables import DeltaTable

    paths = pipeline.lake.table(table.qualified_name)
    version_before = DeltaTable.forPath(spark, paths.mirror).history(1).select("version").first()[0]
    bounds: list[tuple[int, int]] = []
    sampler = Sampler(os.getpid(), lifetime_peak=False).start()
    batches = []
    started = time.monotonic()
    applied = 0
    position = pipeline.position(recorded) if recorded is not None else None
    while position is None or position < end_lsn:
        clock = jvm_clock(spark)
        report = pipeline.stream_batch(spark, recorded, run_id)
        spent = jvm_spent(spark, clock)
        recorded = report.offset
        previous, position = position, pipeline.position(recorded)
        bounds.append((previous, position))
        pipeline.acknowledge(recorded)
        applied += report.changes
        batches.append({"t": round(time.monotonic() - started, 2), "changes": report.changes,
                        "transactions": report.transactions, "seconds": report.seconds,
                        "phases": getattr(report, "phase_seconds", {}), "lag_bytes": report.lag_bytes,
                        "jvm": spent})  # fmt: skip
        print(f"[stream] batch {len(batches)}: {report.changes:,} changes in {report.seconds:.1f} s "
              f"{batches[-1]['phases']}", flush=True)  # fmt: skip
        if len(batches) > 10_000:
            raise RuntimeError("the stream did not reach the end of the workload")
    apply_seconds = time.monotonic() - started
    usage = sampler.finish()

    # check
    mirror = spark.read.format("delta").load(paths.mirror)
    mirror_sums = mirror.selectExpr(*SUMS).first()
    with admin_connect() as conn:
        source_sums = conn.execute(f"select count(*), sum(id), sum(amount) from {TABLE}").fetchone()
    check = {"source": [str(v) for v in source_sums], "mirror": [str(v) for v in mirror_sums]}
    if [str(v) for v in source_sums] != [str(v) for v in mirror_sums]:
        raise RuntimeError(f"mirror differs from source: {check}")

    # 5. and 6., Spark and Delta alone on the same batches, then ours again; in rounds, the last one reported
    floors, replays = [], []
    keys = list(table.key_columns)
    for number in range(1, args.warm_rounds + 1):
        floor = delta_floor(spark, paths.mirror, paths.changelog, version_before, bounds, keys, lake)
        if floor["sums"] != check["mirror"]:
            raise RuntimeError(f"the floor's mirror differs from ours: {floor['sums']} vs {check['mirror']}")
        replay = warm_replay(spark, paths.mirror, paths.changelog, version_before, bounds, keys, lake)
        if replay["sums"] != check["mirror"]:
            raise RuntimeError(f"the warm replay's mirror differs from ours: {replay['sums']} vs {check['mirror']}")
        print(f"[stream] round {number}: floor: changelog append {floor['append_seconds']:.1f} s, MERGE "
              f"{floor['merge_seconds']:.1f} s; ours again: changelog {replay['changelog_seconds']:.1f} s, merge "
              f"{replay['merge_seconds']:.1f} s", flush=True)  # fmt: skip
        floors.append(floor)
        replays.append(replay)

    # 7. the lake upkeep a stream run does between batches (at most every stream.compact_seconds / vacuum_seconds)
    from cdc_assets.lake.maintenance import maintain_lake

    def files() -> dict[str, int]:
        return {kind: len(spark.read.format("delta").load(path).inputFiles())
                for kind, path in (("mirror", paths.mirror), ("changelog", paths.changelog))}  # fmt: skip

    files_before = files()
    started = time.monotonic()
    upkeep = maintain_lake(spark, pipeline.lake, [table.qualified_name], 64 * MB)[0]
    upkeep_seconds = time.monotonic() - started
    files_after = files()
    after_sums = mirror.selectExpr("count(*)", "sum(id)", "sum(amount)").first()
    if [str(v) for v in after_sums] != [str(v) for v in mirror_sums]:
        raise RuntimeError(f"the upkeep changed the mirror: {list(after_sums)} vs {list(mirror_sums)}")
    print(f"[stream] upkeep: {upkeep_seconds:.1f} s, files {files_before} -> {files_after}", flush=True)
    spark.stop()
    return {
        "machine": machine(),
        "spark_start_seconds": spark_seconds,
        "initial_rows": args.initial_rows,
        "initial_seconds": initial_seconds,
        "workload": {"changes": changes, "transactions": transactions, "seconds": workload_seconds, "wal_bytes": wal},
        "decode": decode,
        "ours": {"changes": applied, "seconds": apply_seconds, "batches": batches, "usage": usage_json(usage)},
        "check": check,
        "floor": floors[-1],
        "warm_replay": replays[-1],
        "earlier_rounds": {"floor": floors[:-1], "warm_replay": replays[:-1]},
        "upkeep": {"seconds": upkeep_seconds, "files_before": files_before, "files_after": files_after,
                   "staging_files_dropped": upkeep.staging_files_dropped, "files_vacuumed": upkeep.files_vacuumed},
    }  # fmt: skip


SUMS = ("count(*)", "sum(id)", "sum(amount)")


def restored_copy(spark: Any, mirror_path: str, version: int, work: Path) -> str:
    """A copy of the mirror at ``mirror_path`` in ``work/mirror`` (``work`` emptied first), restored to ``version``
    (Delta ``RESTORE``: the copy's log keeps the later commits, its current files are those of ``version``)."""
    from cdc_assets.lake.mirror import q

    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(mirror_path, work / "mirror")
    spark.sql(f"RESTORE TABLE delta.{q(str(work / 'mirror'))} TO VERSION AS OF {version}")
    return str(work / "mirror")


def summed(batches: list[dict[str, Any]], *names: str) -> dict[str, Any]:
    """``batches`` and, for each of ``names``, its sum over them."""
    return {"batches": batches, **{name: sum(b[name] for b in batches) for name in names}}


def delta_floor(
    spark: Any, mirror_path: str, changelog_path: str, version: int, bounds: list[tuple[int, int]],
    key_columns: list[str], lake: Path,
) -> dict[str, Any]:  # fmt: skip
    """Step 5 of the module docstring: Spark and Delta alone on the batches ``bounds`` (``_cdc_position`` ranges),
    starting from the mirror's ``version``. Returns the timed seconds per batch and the copy's sums."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    from cdc_assets.lake.delta_tables import table_state
    from cdc_assets.lake.mirror import (
        merge_net_changes,
        merge_write_conf,
        mirror_source_fields,
        q,
        takes_two_statements,
    )
    from cdc_assets.lake.spark import session_conf
    from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN

    work = lake / "floor"
    mirror = DeltaTable.forPath(spark, restored_copy(spark, mirror_path, version, work))
    columns = [f.name for f in mirror_source_fields(mirror)]
    changelog = spark.read.format("delta").load(changelog_path)
    keys = [f"_k_{k}" for k in key_columns]
    latest = Window.partitionBy(*keys).orderBy(F.col("_cdc_position").desc(), F.col("_cdc_seq").desc())
    batches = []
    timed_jvm_cpu = 0.0
    for number, (low, high) in enumerate(bounds):
        rows = changelog.where((F.col("_cdc_position") > low) & (F.col("_cdc_position") <= high))
        rows.write.parquet(str(work / f"changes-{number}"))
        net = (
            rows.select("*", *[F.coalesce(F.col(f"after.{q(k)}"), F.col(f"before.{q(k)}")).alias(f"_k_{k}")
                               for k in key_columns])
            .withColumn("_rank", F.row_number().over(latest))
            .where(F.col("_rank") == 1)
            .select(*keys, F.when(F.col("_cdc_op") == "d", "d").otherwise("u").alias("_kind"),
                    *[F.col(f"after.{q(c)}").alias(c) for c in [*columns, UNREPRESENTABLE_COLUMN]],
                    "_cdc_op", "_cdc_position", "_cdc_ts", F.lit(None).cast("array<string>").alias("_cdc_unknown"))
        )  # fmt: skip
        net.write.parquet(str(work / f"net-{number}"))
        changes = spark.read.parquet(str(work / f"changes-{number}"))
        # the settings and statement count apply_changes would take for the copy's size now (read untimed)
        size = table_state(spark, mirror, str(work / "mirror")).size_bytes
        sampler = Sampler(os.getpid(), interval=0.1, lifetime_peak=False).start()
        clock = jvm_clock(spark)
        started = time.monotonic()
        changes.write.format("delta").mode("append").save(str(work / "changelog"))
        append_seconds = time.monotonic() - started
        started = time.monotonic()
        with session_conf(spark, merge_write_conf(size)):
            merge_net_changes(mirror, spark.read.parquet(str(work / f"net-{number}")), columns, key_columns,
                              str(work / "mirror"), two_statements=takes_two_statements(size))  # fmt: skip
        merge_seconds = time.monotonic() - started
        spent = jvm_spent(spark, clock)
        timed_jvm_cpu += sampler.finish()["jvm"].cpu_seconds
        batches.append({"changes": changes.count(), "append_seconds": append_seconds, "merge_seconds": merge_seconds,
                        "jvm": spent})  # fmt: skip
    sums = [str(v) for v in mirror.toDF().selectExpr(*SUMS).first()]
    shutil.rmtree(work, ignore_errors=True)
    return {**summed(batches, "append_seconds", "merge_seconds"), "jvm_cpu_seconds": timed_jvm_cpu, "sums": sums}


def jvm_spent(spark: Any, since: JvmClock | None) -> dict[str, float] | None:
    """The driver JVM's compile and collection seconds since ``since`` (``JvmClock.to_json``), None without one."""
    now = jvm_clock(spark)
    return None if now is None or since is None else (now - since).to_json()


def warm_replay(
    spark: Any, mirror_path: str, changelog_path: str, version: int, bounds: list[tuple[int, int]],
    key_columns: list[str], lake: Path,
) -> dict[str, Any]:  # fmt: skip
    """Step 6 of the module docstring: our own Spark work on the same batches again, after the floor (a JVM at least
    as warm as the floor's): for each batch, its changes taken from our changelog and written to Parquet (untimed),
    then, timed, the pipeline's ``append_changelog`` of them, cached as the stream caches its spill, to a fresh
    changelog, and its ``apply_changes`` (net change per key, the MERGE) into a copy of the mirror restored to
    ``version``. No slot read, no decode, no reconciliation. Set against step 4's phases it shows how much of them
    was the JVM's warm-up (its JIT compilers' seconds are recorded per batch) rather than the work; set against
    the floor, what the pipeline's own statements add to Delta's. Returns the seconds per batch and the copy's
    sums."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from cdc_assets.lake.mirror import append_changelog, apply_changes, mirror_source_fields

    work = lake / "warm_replay"
    fields = mirror_source_fields(DeltaTable.forPath(spark, restored_copy(spark, mirror_path, version, work)))
    changelog = spark.read.format("delta").load(changelog_path)
    batches = []
    for number, (low, high) in enumerate(bounds):
        rows = changelog.where((F.col("_cdc_position") > low) & (F.col("_cdc_position") <= high))
        rows.write.parquet(str(work / f"changes-{number}"))
        changes = spark.read.parquet(str(work / f"changes-{number}")).cache()
        try:
            clock = jvm_clock(spark)
            started = time.monotonic()
            append_changelog(spark, str(work / "changelog"), changes, high)
            changelog_seconds = time.monotonic() - started
            started = time.monotonic()
            apply_changes(spark, str(work / "mirror"), changes, fields, key_columns, set())
            merge_seconds = time.monotonic() - started
            spent = jvm_spent(spark, clock)
            batches.append({"changes": changes.count(), "changelog_seconds": changelog_seconds,
                            "merge_seconds": merge_seconds, "jvm": spent})  # fmt: skip
        finally:
            changes.unpersist()
    sums = [str(v) for v in spark.read.format("delta").load(str(work / "mirror")).selectExpr(*SUMS).first()]
    shutil.rmtree(work, ignore_errors=True)
    return {**summed(batches, "changelog_seconds", "merge_seconds"), "sums": sums}


def phase_totals(batches: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's seconds summed over the run's ``batches`` (their ``phases``)."""
    phases: dict[str, float] = {}
    for batch in batches:
        for name, seconds in batch["phases"].items():
            phases[name] = phases.get(name, 0.0) + seconds
    return phases


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    changes = result["workload"]["changes"]
    count_runs = [d for d in result["decode"] if d["kind"] == "peek count(*)"]
    best = min(count_runs, key=lambda d: d["seconds"])
    limit = changes / best["seconds"]
    ours = result["ours"]
    ours_rate = ours["changes"] / ours["seconds"]
    workload = result["workload"]
    rows: list[list[Any]] = [
        ["workload (server procedure)", changes, changes + 2 * workload["transactions"], workload["seconds"],
         changes / workload["seconds"], None],
    ]  # fmt: skip
    for d in result["decode"]:
        rows.append([f"{d['kind']} #{d['repeat']}", changes, d["messages"], d["seconds"], changes / d["seconds"],
                     d["pg_cpu"]])  # fmt: skip
    usage = ours["usage"]
    rows.append(["ours: stream_batch + acknowledge", ours["changes"], None, ours["seconds"], ours_rate,
                 usage.get("pg_backends", {}).get("cpu_seconds")])  # fmt: skip
    print()
    print_table(
        f"Streaming throughput ({machine()}; {changes:,} changes ({args.mix}) in transactions of {args.tx_size}, "
        f"{result['workload']['wal_bytes'] / MB:.1f} MB WAL, mirror of {args.initial_rows:,} rows, "
        f"batch bound {args.max_changes:,})",
        ["what", "changes", "messages", "seconds", "changes/s", "pg cpu s"],
        rows,
    )
    phases = phase_totals(ours["batches"])
    rates = [b["changes"] / b["seconds"] for b in ours["batches"] if b["changes"] and b["seconds"]]
    print(f"  ratio ours / decode limit: {ours_rate / limit:.3f} ({ours_rate:,.0f} vs {limit:,.0f} changes/s)")
    print(f"  batches: {len(ours['batches'])}, changes/s per batch p50 {percentile(rates, 50) or 0:,.0f}, "
          f"min {min(rates, default=0):,.0f}, max {max(rates, default=0):,.0f}")  # fmt: skip
    print(f"  our phase seconds (sum over batches): { {k: round(v, 1) for k, v in phases.items()} }")
    print(f"  our processes: {usage}")
    floor = result["floor"]
    floor_seconds = floor["append_seconds"] + floor["merge_seconds"]
    floor_rate = ours["changes"] / floor_seconds
    print(f"  floor, Spark + Delta alone on the same batches (warm JVM, no read or decode): changelog append "
          f"{floor['append_seconds']:.1f} s + MERGE of the precomputed net changes {floor['merge_seconds']:.1f} s = "
          f"{floor_seconds:.1f} s, {floor_rate:,.0f} changes/s; JVM CPU {floor['jvm_cpu_seconds']:.1f} s")  # fmt: skip
    print(f"  ratio ours / floor: {ours_rate / floor_rate:.3f}; targets against the floor: 100,000 changes/s is "
          f"{100_000 / floor_rate:.2f}x it, 0.25x the decode limit ({0.25 * limit:,.0f}) is "
          f"{0.25 * limit / floor_rate:.2f}x it")  # fmt: skip
    for line in warm_lines(result):
        print(line)
    print(f"  Spark start-up {result['spark_start_seconds']:.1f} s (once, not in the figures above)")
    upkeep = result["upkeep"]
    print(f"  lake upkeep after the workload (maintain_lake): {upkeep['seconds']:.1f} s; files "
          f"{upkeep['files_before']} -> {upkeep['files_after']}; staging files dropped "
          f"{upkeep['staging_files_dropped']}")  # fmt: skip
    plot(result, limit, args.mix)


def _jvm_total(batches: list[dict[str, Any]], key: str) -> float:
    return sum((b.get("jvm") or {}).get(key, 0.0) for b in batches)


def warm_lines(result: dict[str, Any]) -> list[str]:
    """What step 6 (``warm_replay``) says about step 4: our changelog and merge phases again on a warm JVM against
    the floor's append and MERGE and against step 4's own; the JIT compilers' and collectors' seconds of the three;
    and the ratio to the floor step 4 would have had with its changelog and merge phases at the warm replay's
    seconds (its read and reconciliation as measured). Nothing when the record has no warm replay (older runs)."""
    replay = result.get("warm_replay")
    if not replay or not replay.get("batches"):
        return []
    ours, floor = result["ours"], result["floor"]
    phases = phase_totals(ours["batches"])
    run_work = phases.get("changelog", 0.0) + phases.get("merge", 0.0)
    warm_work = replay["changelog_seconds"] + replay["merge_seconds"]
    floor_seconds = floor["append_seconds"] + floor["merge_seconds"]
    lines = [
        f"  ours again on a warm JVM (changelog append + apply_changes of the same batches, no read): changelog "
        f"{replay['changelog_seconds']:.1f} + merge {replay['merge_seconds']:.1f} = {warm_work:.1f} s, "
        f"{warm_work / floor_seconds:.2f}x the floor's {floor_seconds:.1f} s; in the run the same phases took "
        f"{phases.get('changelog', 0.0):.1f} + {phases.get('merge', 0.0):.1f} = {run_work:.1f} s: "
        f"{run_work - warm_work:.1f} s more, a JVM warming up"
    ]
    first = (ours["batches"][0].get("jvm") or {}) if ours["batches"] else {}
    lines.append(
        f"  JIT compilers' seconds (all threads; 2 cores): {_jvm_total(ours['batches'], 'compile_seconds'):.1f} in "
        f"the run's batches (first batch {first.get('compile_seconds', 0.0):.1f}), "
        f"{_jvm_total(floor['batches'], 'compile_seconds'):.1f} in the floor's, "
        f"{_jvm_total(replay['batches'], 'compile_seconds'):.1f} in the warm replay's; collectors' "
        f"{_jvm_total(ours['batches'], 'gc_seconds'):.1f}, {_jvm_total(floor['batches'], 'gc_seconds'):.1f}, "
        f"{_jvm_total(replay['batches'], 'gc_seconds'):.1f}"
    )
    warm_seconds = ours["seconds"] - run_work + warm_work
    if warm_seconds > 0 and floor_seconds > 0:
        ratio = (ours["changes"] / warm_seconds) / (ours["changes"] / floor_seconds)
        rest = {k: round(v, 1) for k, v in phases.items() if k not in ("changelog", "merge")}
        lines.append(
            f"  ratio ours / floor with the run's changelog and merge phases at the warm replay's seconds: "
            f"{ratio:.3f} ({warm_seconds:.1f} s; what is left besides them: {rest})"
        )
    return lines


def plot(result: dict[str, Any], limit: float, mix: str = "update-heavy") -> None:
    plt = pyplot()
    batches = result["ours"]["batches"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rates = [b["changes"] / b["seconds"] if b["seconds"] else 0 for b in batches]
    left.bar(range(1, len(batches) + 1), rates, label="ours, per batch")
    floor = [b for b in result.get("floor", {}).get("batches", []) if b["changes"]]
    if floor:
        floor_batches = [i + 1 for i, b in enumerate(batches) if b["changes"]]
        floor_rates = [b["changes"] / (b["append_seconds"] + b["merge_seconds"]) for b in floor]
        left.plot(floor_batches, floor_rates, "k_", markersize=40, mew=2, label="floor: Spark + Delta alone")
    left.axhline(100_000, color="grey", linestyle=":", label="target 100k changes/s")
    left.axhline(limit, color="red", linestyle="--", label="decode limit (peek count)")
    left.set_xlabel("batch")
    left.set_ylabel("changes/s")
    left.set_yscale("log")
    left.legend()
    left.set_title("Changes/s per stream batch")
    names = sorted({n for b in batches for n in b["phases"]})
    bottom = [0.0] * len(batches)
    for name in names:
        values = [b["phases"].get(name, 0.0) for b in batches]
        right.bar(range(1, len(batches) + 1), values, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    right.set_xlabel("batch")
    right.set_ylabel("seconds")
    right.set_title("Batch phases")
    right.legend(fontsize=8)
    save_figure(fig, "stream_batches.png" if mix == "update-heavy" else f"stream_batches_{mix}.png")


if __name__ == "__main__":
    sys.exit(main())
