"""A stream run orphaned by the loss of the processes that ran it (``kill -9`` of everything Dagster started, as a
lost machine or a killed ``dagster dev``) is ended by Dagster's run monitor at its ``dagster/max_runtime`` tag, and
the streaming sensor then launches the next run, which goes on from the recorded offset. A snapshot run orphaned with
it (held in its read, then lost) is ended at its own ``dagster/max_runtime`` (the source's
``snapshot_run_max_runtime_seconds``) and run again by the daemon's automatic retries (``dagster/max_retries``,
``snapshot_run_retries``; the instance's ``run_retries``): its chunk is read and reaches the mirror. Without those
tags it stays STARTED, holds a run slot, and its chunk is never read (the planner requests a chunk once).

A backfill's run launched from the UI carries none of those tags (the UI asks for none; its tags are the backfill's
own): it is held and lost the same way, and the instance's defaults (``run_monitoring.max_runtime_seconds``,
``run_retries.max_retries`` in the demo's ``dagster.yaml``, the bound shortened here) end it and run it again, and the
backfill completes. Before those defaults it stayed STARTED for good, and its backfill with it (its runs go one at a
time).

Real processes throughout: ``dagster-daemon run`` (sensors, run queue, run monitor, the code server it starts and
the runs that server launches, each with its Spark driver) on a SQLite instance with the demo's ``dagster.yaml``
(its monitor's poll shortened), a real PostgreSQL source and a Delta mirror. Without the tag the orphaned run stays
STARTED and every sensor tick skips "still in flight" (found in the demo on 2026-12-04): this test then times out
waiting for the run to fail.

Beside it, a second source whose server never answers (a port that accepts connections and stays silent: a hung
server) has a stream sensor whose every tick waits ``SILENT_SECONDS`` for its connection. Dagster's daemon evaluates
sensors one after another unless the instance says ``sensors: use_threads``; then each of those ticks held back the
first source's stream sensor by as long (found in the demo on 2026-12-05: 38 s between two stream runs). With the
demo's ``dagster.yaml`` the first source's sensor records its lag every ``interval_seconds`` throughout.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
import yaml
from dagster import AssetRecordsFilter, DagsterEventType, DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter
from dagster._core.definitions.assets.graph.asset_graph import AssetGraph
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.instance.ref import InstanceRef

from cdc_assets.assets import build_table_asset, chunk_partitions, stream_asset_key, table_asset_key
from cdc_assets.config import parse_config
from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS
from sensors.stream import MAX_RETRIES_TAG, MAX_RUNTIME_TAG
from tests.integration.support import PG_PORT, READER_PASSWORD, T, create_source, drop_source, run_pid
from tests.integration.support import wait_for as support_wait_for

DATABASE = "orphan_run"
SOURCE = "orphan"
JOB = f"{SOURCE}_stream"
ROOT = Path(__file__).resolve().parents[2]
RUN_SECONDS = 20
# above the longest batch a run of this test takes (docs/configuration.md: "keep the overrun above the longest
# batch"): the batch that reconciles the retried snapshot's chunk, in a driver just started. With 10 s, on a slow
# machine (2026-12-07) every stream run after the restart was terminated at its 30 s inside that reconciliation, none
# completed a batch, and the test gave up after 626 s; the orphan's bound starts before the first daemon is killed,
# so a longer one delays the test by little
MAX_OVERRUN_SECONDS = 60
STREAM_MAX_RUNTIME_SECONDS = RUN_SECONDS + MAX_OVERRUN_SECONDS  # each stream run's dagster/max_runtime
# both above the first daemon's life (once, with 90 s, the restarted monitor failed the held snapshot run at once)
SNAPSHOT_MAX_RUNTIME_SECONDS = 150
DEFAULT_MAX_RUNTIME_SECONDS = 120  # the instance's bound of a run without its own (6 hours in the demo's dagster.yaml)
SILENT_SECONDS = 20  # the silent source's connect_timeout: how long each of its sensor's ticks waits
INTERVAL_SECONDS = 5

CONFIG = """
lake_root: {lake}
spark: {{master: "local[2]", conf: {{spark.driver.extraJavaOptions: "{driver_options}"}}}}
sources:
  - name: {source}
    kind: postgres
    connection:
      {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader, password: "${{ORPHAN_PW}}"}}
    slot: {database}
    publication: {database}
    startup_mode: initial
    snapshot_run_max_runtime_seconds: {snapshot_max_runtime}
    include: ["public.pairs"]
    checks: {{cron: "off"}}
    # no successor before the run ends (handoff_seconds 0): one requested before the kill would be lost with it too
    stream:
      {{interval_seconds: {interval}, run_seconds: {run_seconds}, max_overrun_seconds: {overrun}, handoff_seconds: 0}}
  - name: silent
    kind: postgres
    connection:
      {{host: 127.0.0.1, port: {silent_port}, dbname: silent, user: silent_reader, password: "${{ORPHAN_PW}}",
       connect_timeout: {silent_seconds}}}
    slot: silent
    publication: silent
    startup_mode: latest
    include: ["public.pairs"]
    checks: {{cron: "off"}}
    stream: {{interval_seconds: {interval}, sensor_timeout_seconds: 50}}
"""


def wait_for(what: str, probe: Callable[[], T], timeout: float, log: Path) -> T:
    """``tests.integration.support.wait_for`` with the daemon log's tail in its failure."""
    return support_wait_for(what, probe, timeout, context=lambda: f"; daemon log:\n{log.read_text()[-4000:]}")


@contextmanager
def daemon(home: Path, config: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``dagster-daemon run`` on ``home``'s instance and the project's root ``Definitions``, in its own process group
    (with the code server and the runs it starts); killed with the whole group on exit."""
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "CDC_CONFIG": str(config),
        "ORPHAN_PW": READER_PASSWORD,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    with log.open("a") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-m", "cdc_assets.definitions"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield process
    finally:
        kill_group(process)


def launch_backfill_as_the_ui_does(instance: DagsterInstance, config_text: str, tmp_path: Path) -> str:
    """A backfill of every chunk of the source's table, added to the instance as the UI's "Launch backfill" adds one
    (its GraphQL mutation builds the same ``PartitionBackfill`` and adds it; no tags asked for); the daemon's backfill
    loop launches its run. The backfill's id."""
    source = parse_config(yaml.safe_load(config_text), tmp_path, {"ORPHAN_PW": READER_PASSWORD}).source(SOURCE)
    table = build_table_asset(source, "public.pairs")
    partitions = instance.get_dynamic_partitions(chunk_partitions(SOURCE, "public.pairs").name)
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id="uibackfill", asset_graph=AssetGraph.from_assets([table]),
        partition_names=partitions, asset_selection=[table.key], backfill_timestamp=time.time(), tags={},
        dynamic_partitions_store=instance, all_partitions=False, title=None, description=None, run_config=None,
    )  # fmt: skip
    instance.add_backfill(backfill)
    return backfill.backfill_id


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to every process of the group: the daemon, its code server, the runs and their Spark drivers; nothing
    gets to report anything."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that takes connections and never answers (a hung server), as test_definitions' silent
    sources: the kernel completes the handshake; nothing ever reads or answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(128)
        yield silent.getsockname()[1]


@pytest.fixture
def orphan_source(postgres_server: dict[str, str]) -> Iterator[str]:
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, DATABASE)
    yield f"{admin_dsn} dbname={DATABASE}"
    drop_source(admin_dsn, DATABASE)


def test_a_stream_run_lost_with_its_code_server_is_ended_at_its_max_runtime_and_the_next_run_goes_on(
    orphan_source: str, silent_port: int, spark, tmp_path: Path
) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    instance_yaml = yaml.safe_load((ROOT / "dagster_home" / "dagster.yaml").read_text())
    assert instance_yaml["run_retries"]["max_retries"] >= 1, instance_yaml.get("run_retries")
    assert instance_yaml["run_monitoring"]["max_runtime_seconds"] > 0, instance_yaml.get("run_monitoring")
    instance_yaml["run_monitoring"].update(
        {"poll_interval_seconds": 2, "max_runtime_seconds": DEFAULT_MAX_RUNTIME_SECONDS}
    )
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml))
    assert instance_yaml["sensors"]["use_threads"] is True, instance_yaml.get("sensors")
    config = tmp_path / "cdc.yaml"
    config_text = CONFIG.format(
        lake=tmp_path / "lake", driver_options=SHORT_LIVED_DRIVER_OPTIONS, source=SOURCE, port=PG_PORT,
        database=DATABASE, run_seconds=RUN_SECONDS, overrun=MAX_OVERRUN_SECONDS, interval=INTERVAL_SECONDS,
        silent_port=silent_port, silent_seconds=SILENT_SECONDS, snapshot_max_runtime=SNAPSHOT_MAX_RUNTIME_SECONDS,
    )  # fmt: skip
    config.write_text(config_text)
    log = tmp_path / "daemon.log"
    instance = DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    admin = psycopg.connect(orphan_source, autocommit=True)
    admin.execute("set synchronous_commit = on")

    def runs(*statuses: DagsterRunStatus):
        return instance.get_run_records(RunsFilter(job_name=JOB, statuses=list(statuses)))

    def snapshot_runs(*statuses: DagsterRunStatus, **tags: str):
        return instance.get_run_records(
            RunsFilter(tags={"cdc/reason": "initial snapshot", **tags}, statuses=list(statuses))
        )

    def backfill_runs(*statuses: DagsterRunStatus, **tags: str):
        return instance.get_run_records(
            RunsFilter(tags={"dagster/backfill": "uibackfill", **tags}, statuses=list(statuses))
        )

    def run_start(run_id: str) -> float:
        return instance.get_run_record_by_id(run_id).start_time

    def applied_batches(run_id: str) -> int:
        return len(instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records)

    try:
        # a row that no change the slot holds carries (the slot is made again after it): only a snapshot reads it
        admin.execute("insert into pairs values (0, 'snapshotted', 0, 'z')")
        admin.execute("select pg_drop_replication_slot(%s)", [DATABASE])
        admin.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [DATABASE])
        with daemon(home, config, log) as first:
            (started,) = wait_for("a snapshot run started", lambda: snapshot_runs(DagsterRunStatus.STARTED), 180, log)
            lost_snapshot = started.dagster_run
            pid = support_wait_for("its process", lambda: run_pid(instance, lost_snapshot.run_id), 30, 0.1)
            os.kill(pid, signal.SIGSTOP)  # held before its chunk is staged (checked below), then lost with the rest
            assert lost_snapshot.tags["dagster/max_retries"] == "3", lost_snapshot.tags
            assert lost_snapshot.tags[MAX_RUNTIME_TAG] == str(SNAPSHOT_MAX_RUNTIME_SECONDS), lost_snapshot.tags
            backfill_id = launch_backfill_as_the_ui_does(instance, config_text, tmp_path)
            (held,) = wait_for("the backfill's run started", lambda: backfill_runs(DagsterRunStatus.STARTED), 180, log)
            lost_backfill = held.dagster_run
            pid = support_wait_for("its process", lambda: run_pid(instance, lost_backfill.run_id), 30, 0.1)
            os.kill(pid, signal.SIGSTOP)  # held before its chunk is read, as the snapshot run
            # the UI's backfill gives its runs no bound and no retries: the instance's defaults are theirs
            assert not {MAX_RETRIES_TAG, MAX_RUNTIME_TAG} & set(lost_backfill.tags), lost_backfill.tags
            # a change for the stream now: the sensor's first run may have ended meanwhile with nothing left to read
            admin.execute("insert into pairs values (1, 'before the loss', 1, 'x')")

            def streaming() -> list:
                return [r for r in runs(DagsterRunStatus.STARTED) if applied_batches(r.dagster_run.run_id)]

            (record, *_) = wait_for("a stream run in flight with a batch applied", streaming, 180, log)
            orphan = record.dagster_run
            assert orphan.tags[MAX_RUNTIME_TAG] == str(STREAM_MAX_RUNTIME_SECONDS), orphan.tags
            assert orphan.tags[MAX_RETRIES_TAG] == "0", orphan.tags  # the sensor requests the next one
            kill_group(first)
            held_for = {run.run_id: time.time() - run_start(run.run_id) for run in (lost_snapshot, lost_backfill)}
            # both still STARTED below only if their bounds outlast the first daemon: otherwise raise the bounds
            assert held_for[lost_snapshot.run_id] < SNAPSHOT_MAX_RUNTIME_SECONDS, held_for
            assert held_for[lost_backfill.run_id] < DEFAULT_MAX_RUNTIME_SECONDS, held_for
        admin.execute("insert into pairs values (2, 'after the loss', 2, 'y')")
        time.sleep(5)
        assert instance.get_run_by_id(orphan.run_id).status == DagsterRunStatus.STARTED  # nothing reported it
        assert instance.get_run_by_id(lost_snapshot.run_id).status == DagsterRunStatus.STARTED
        assert instance.get_run_by_id(lost_backfill.run_id).status == DagsterRunStatus.STARTED
        pairs = table_asset_key(SOURCE, "public.pairs")
        assert not instance.get_materialized_partitions(pairs), "the held snapshot run read its chunk before the loss"

        restarted = time.time()
        with daemon(home, config, log):
            wait_for(
                "the orphaned run ended by the run monitor",
                lambda: instance.get_run_by_id(orphan.run_id).status == DagsterRunStatus.FAILURE,
                STREAM_MAX_RUNTIME_SECONDS + 120, log,
            )  # fmt: skip
            ended = instance.get_run_record_by_id(orphan.run_id)
            assert ended.end_time - ended.start_time >= STREAM_MAX_RUNTIME_SECONDS
            messages = [entry.message for entry in instance.all_logs(orphan.run_id)]
            expected_message = f"maximum runtime of {STREAM_MAX_RUNTIME_SECONDS} seconds"
            assert any(expected_message in message for message in messages), messages[-5:]

            def successor_applied() -> list[str]:
                later = [r.dagster_run.run_id for r in runs() if r.dagster_run.run_id != orphan.run_id]
                return [run_id for run_id in later if applied_batches(run_id)]

            wait_for("a batch of the next stream run", successor_applied, 240, log)

            def ended_at_its_bound_then_retried(lost: DagsterRun, matching: Callable, bound: int) -> None:
                (retried,) = wait_for(
                    f"the lost run {lost.run_id} failed at its max runtime ({bound} s), then retried and succeeded",
                    lambda: matching(DagsterRunStatus.SUCCESS, **{"dagster/parent_run_id": lost.run_id}), 240, log,
                )  # fmt: skip
                assert instance.get_run_by_id(lost.run_id).status == DagsterRunStatus.FAILURE
                messages = [entry.message for entry in instance.all_logs(lost.run_id)]
                assert any(f"maximum runtime of {bound} seconds" in message for message in messages), messages[-5:]
                assert retried.dagster_run.tags["dagster/retry_number"] == "1", retried.dagster_run.tags

            ended_at_its_bound_then_retried(lost_snapshot, snapshot_runs, SNAPSHOT_MAX_RUNTIME_SECONDS)
            # the backfill's run at the instance's default bound: it carries none of its own
            ended_at_its_bound_then_retried(lost_backfill, backfill_runs, DEFAULT_MAX_RUNTIME_SECONDS)
            wait_for(
                "the backfill completed",
                lambda: instance.get_backfill(backfill_id).status == BulkActionStatus.COMPLETED_SUCCESS, 120, log,
            )  # fmt: skip
            chunks = set(instance.get_dynamic_partitions(chunk_partitions(SOURCE, "public.pairs").name))
            assert chunks and instance.get_materialized_partitions(pairs) == chunks
            mirror_path = str(tmp_path / "lake" / SOURCE / "public.pairs" / "mirror")

            def mirrored() -> list[tuple[int, str]]:
                return sorted((r["region"], r["code"]) for r in spark.read.format("delta").load(mirror_path).collect())

            expected = [(0, "snapshotted"), (1, "before the loss"), (2, "after the loss")]
            wait_for("the retried snapshot's row reconciled into the mirror", lambda: mirrored() == expected, 180, log)
            lag_recorded = [
                record.timestamp
                for record in instance.fetch_observations(
                    AssetRecordsFilter(asset_key=stream_asset_key(SOURCE), after_timestamp=restarted), limit=1000,
                    ascending=True,
                ).records
            ]  # fmt: skip
        daemon_log = log.read_text()
        silent_ticks = daemon_log.count("caught an error for sensor silent_stream_sensor")  # each waited, then failed
        assert silent_ticks >= 2 and "source 'silent': cannot connect" in daemon_log, daemon_log[-4000:]
        gaps = [later - earlier for earlier, later in itertools.pairwise(lag_recorded)]
        assert len(lag_recorded) >= 6 and max(gaps) < SILENT_SECONDS - INTERVAL_SECONDS, (lag_recorded, gaps)
        assert mirrored() == expected
        assert instance.get_latest_materialization_event(stream_asset_key(SOURCE)) is not None
    finally:
        admin.close()
        instance.dispose()
