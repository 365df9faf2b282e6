"""The everyday operations, done the way a user does them: in the Dagster UI, in a real browser.

Headless Chromium (Debian's package) driven by Playwright against ``dagster dev`` on a small demo database
(``tests/browser/conftest.py``): the offset job refused from the Launchpad, a table added at the source, planned
after "Reload definitions" and two of its chunk partitions backfilled, then a range of them from the command line
(``python -m cdc_assets.cli backfill``, against the same webserver), a 20-chunk snapshot paused and resumed, and
the stream's lag plotted. Each test asserts on what the UI shows and on the lake or the source behind it;
screenshots go to ``.artifacts/browser/``.

The tests run in this order and share the server: the offset refusal comes first, while no stream run has started;
the added table's backfill starts the first stream run (which keeps its Spark driver for ``run_seconds``; a run
started earlier would capture the table from its first change on, see docs/guarantees.md), the paused snapshot's
windows are reconciled by that run, and the lag plots come last. The backfill of two chosen chunks and the table
added were two tests with a backfill each (200 and 350 s); one backfill now shows both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from dagster import AssetKey, DagsterEventType, DagsterRunStatus, RunsFilter
from delta.tables import DeltaTable
from playwright.sync_api import Locator, Page, expect
from pyspark.sql import SparkSession

from cdc_assets.assets import change_offset_job_name, stream_asset_key, stream_job_name
from cdc_assets.cli import REASON_TAG, REQUESTED_BY_TAG
from cdc_assets.config import load_config
from cdc_assets.engine.chunks import chunk_index, chunk_partition_key
from cdc_assets.engine.windows import RECONCILED, STAGED
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.windows import read_events
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.browser.ui_support import ROOT, SOURCE, UI_TIMEOUT_MS, DagsterUi, screenshot
from tests.integration.support import T, mirror_rows, run_pid, source_rows
from tests.integration.support import wait_for as support_wait_for

pytestmark = pytest.mark.timeout(1200)
# a snapshot run and the stream run that reconciles it each start a Spark driver; the backfill's runs also check
# every chunk once the stream has passed its window
BACKFILL_TIMEOUT_MS = 900_000
RUN_TIMEOUT_MS = 300_000
PLANNER_TIMEOUT_MS = 180_000  # the planner sensor ticks every 5 s here (planner_interval_seconds)
INVALID_LSN = "FFFFFFFF/FFFFFFFF"  # well formed, far ahead of the server's WAL
LAUNCHPAD_CONFIG = f"""ops:
  {SOURCE}_record_offset:
    config:
      lsn: {INVALID_LSN}
      changed_by: browser test
      reason: an offset ahead of the server's WAL must be refused
"""
BACKFILL_ID_TAG = "dagster/backfill"  # the tag Dagster puts on every run of a backfill
BACKFILL_DONE = re.compile(r"^(Succeeded|Completed|Failed|Canceled)$")
# a plot's points and lines are drawn in colour; its axes, grid and labels are grey
COLOURED_PIXELS = """canvas => {
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let coloured = 0;
  for (let i = 0; i < data.length; i += 4) {
    const high = Math.max(data[i], data[i + 1], data[i + 2]), low = Math.min(data[i], data[i + 1], data[i + 2]);
    if (data[i + 3] > 128 && high - low > 80) coloured++;
  }
  return coloured;
}"""


def slot_position(ui: DagsterUi) -> str:
    with ui.admin() as admin:
        row = admin.execute(
            "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = current_database()"
        ).fetchone()
    assert row is not None, "the planner sensor creates the slot at its first tick"
    return row[0]


def latest_offset_event(ui: DagsterUi) -> int | None:
    """The storage id of the stream asset's latest materialization (its recorded offset), None before any."""
    with ui.instance() as instance:
        records = instance.fetch_materializations(stream_asset_key(SOURCE), limit=1).records
        return records[0].storage_id if records else None


def wait_until_shown(page: Page, locator: Locator, timeout_ms: int) -> None:
    """Wait for ``locator`` to show, pressing the page's refresh button now and then (a page refreshes its data on
    its own, but not every view does)."""
    deadline = timeout_ms
    while True:
        try:
            expect(locator).to_be_visible(timeout=min(20_000, deadline))
            return
        except AssertionError:
            deadline -= 20_000
            if deadline <= 0:
                raise
            page.get_by_role("button", name="refresh").first.click()


def launch_backfill(page: Page, choose: Callable[[Locator], None], partitions: int) -> str:
    """On an asset's page: "Materialize…", ``choose`` the partitions in the dialog, launch; returns the backfill id
    from the confirmation."""
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize")
    choose(dialog)
    expect(dialog.get_by_text(f"{partitions} partitions", exact=True)).to_be_visible()
    dialog.get_by_role("button", name="Launch backfill").click()
    created = page.get_by_text(re.compile(r"^Created backfill \w+$"))
    expect(created).to_be_visible()
    return (created.text_content() or "").split()[-1]


def wait_for_backfill(page: Page, ui: DagsterUi, backfill_id: str) -> Locator:
    """Open the backfill's page and wait until its status is final; returns the status."""
    page.goto(f"{ui.url}/runs/b/{backfill_id}")
    status = page.get_by_text("Status", exact=True).locator("xpath=following-sibling::div[1]")
    expect(status).to_have_text(BACKFILL_DONE, timeout=BACKFILL_TIMEOUT_MS)
    return status


def captured(ui: DagsterUi, qualified_name: str):
    """The source's configuration and the captured table (as the pipeline sees it)."""
    config = load_config(ui.config)
    source = config.source(SOURCE)
    return source, PostgresPipeline(config, source).prepare()[qualified_name]


def test_change_offset_from_the_launchpad_refuses_an_lsn_ahead_of_the_server_and_moves_nothing(
    dagster_ui: DagsterUi, page: Page
) -> None:
    page.goto(f"{dagster_ui.url}/locations/cdc_lake/jobs/{change_offset_job_name(SOURCE)}/playground")
    editor = page.locator(".CodeMirror")
    expect(editor).to_be_visible()
    slot_before, offset_before = slot_position(dagster_ui), latest_offset_event(dagster_ui)
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(LAUNCHPAD_CONFIG)  # what pasting the run config does
    launch = page.get_by_role("button", name="Launch Run")
    expect(launch).to_be_enabled()
    screenshot(page, "1-change-offset-launchpad")
    launch.click()
    page.wait_for_url(re.compile(r"/runs/[0-9a-f-]{36}"))
    run_id = page.url.rstrip("/").split("/")[-1].split("?")[0]
    refusal = rf"lsn: {INVALID_LSN} is outside the allowed range \[[0-9A-F]+/[0-9A-F]+, [0-9A-F]+/[0-9A-F]+\]"
    expect(page.get_by_text(re.compile(refusal)).first).to_be_visible(timeout=RUN_TIMEOUT_MS)
    expect(page.get_by_text("Failure", exact=True).first).to_be_visible()
    screenshot(page, "1-change-offset-refused")

    instance = dagster_ui.instance()
    try:
        run = instance.get_run_by_id(run_id)
        assert run is not None and run.job_name == change_offset_job_name(SOURCE), run
        assert run.status == DagsterRunStatus.FAILURE
        # never retried by the daemon (the instance retries runs without this tag): a refused offset is refused again
        assert run.tags.get("dagster/max_retries") == "0", run.tags
        recorded = instance.all_logs(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
    finally:
        instance.dispose()
    assert recorded == []  # no offset recorded by the refused run
    assert latest_offset_event(dagster_ui) == offset_before
    assert slot_position(dagster_ui) == slot_before


def choose_partitions(page: Page, keys: list[str]) -> Callable[[Locator], None]:
    """In the launch dialog: pick ``keys`` from the partition selector, one by one."""

    def choose(dialog: Locator) -> None:
        dialog.get_by_text("Select a partition or create one").click()
        for key in keys:
            page.get_by_role("menuitem", name=key).click()
        dialog.get_by_text("Launch runs to materialize").click()  # closes the list

    return choose


def test_a_table_added_at_the_source_is_planned_after_reload_definitions_and_two_chunks_backfilled_from_the_ui(
    dagster_ui: DagsterUi, page: Page, spark: SparkSession
) -> None:
    """A table created at the source appears after "Reload definitions", the planner plans its three chunks, and a
    backfill of two of them (chosen in the launch dialog) succeeds: the window log holds exactly those two chunks,
    staged and reconciled, and the mirror equals the source."""
    with dagster_ui.admin() as admin:  # in the publication (for all tables); readable by default privileges
        admin.execute("create table refunds (id bigint primary key, order_id bigint, amount numeric(10, 2), note text)")
        admin.execute("insert into refunds select g, 2 * g, g % 50 + 0.5, 'r' || g from generate_series(1, 250) g")
    page.goto(f"{dagster_ui.url}/assets")
    page.get_by_role("button", name="Reload definitions").click()
    asset = page.get_by_role("link", name=f"{SOURCE} / public / refunds")
    expect(asset).to_be_visible(timeout=RUN_TIMEOUT_MS)
    asset.click()
    page.get_by_role("tab", name="Partitions").click()
    chunks = [chunk_partition_key(i) for i in range(3)]  # 250 rows, chunks of 100
    for key in chunks:
        wait_until_shown(page, page.get_by_text(key, exact=True).first, PLANNER_TIMEOUT_MS)
    expect(page.get_by_text("Missing (3)", exact=True)).to_be_visible()
    screenshot(page, "2-added-table-planned")

    wanted = chunks[:2]
    backfill = launch_backfill(page, choose_partitions(page, wanted), 2)
    status = wait_for_backfill(page, dagster_ui, backfill)
    screenshot(page, "2-added-table-two-chunks-backfill")
    expect(status).to_have_text("Succeeded")
    expect(page.get_by_text("100% completed")).to_be_visible()
    for key in wanted:
        expect(page.get_by_text(key, exact=True).first).to_be_visible()  # the partition selection
    page.goto(f"{dagster_ui.url}/assets/{SOURCE}/public/refunds?view=partitions")
    wait_until_shown(page, page.get_by_text("Materialized (2)", exact=True), RUN_TIMEOUT_MS)
    screenshot(page, "2-added-table-materialized")

    # the backfill read exactly the two chosen chunks (the window log), and the mirror equals the source: its rows
    # were inserted after the slot existed, so the stream carries them too (in `latest` mode, from their insert on)
    lake = SourceLake(dagster_ui.lake, SOURCE)
    events = read_events(spark, lake.windows)
    staged = {e.window.chunk for e in events if e.window.table == "public.refunds" and e.event == STAGED}
    reconciled = {e.window.chunk for e in events if e.window.table == "public.refunds" and e.event == RECONCILED}
    assert staged == reconciled == {0, 1}, (staged, reconciled)
    source, table = captured(dagster_ui, "public.refunds")
    expected = source_rows(source, table)
    assert len(expected) == 250
    assert mirror_rows(spark, lake.table("public.refunds").mirror, table) == expected


def run_backfill_cli(ui: DagsterUi, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cdc_assets.cli", "backfill", "--url", ui.url, "--source", SOURCE, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_range_of_chunks_backfilled_from_the_command_line_runs_like_one_from_the_ui(
    dagster_ui: DagsterUi, page: Page, spark: SparkSession
) -> None:
    """``python -m cdc_assets.cli backfill`` against the webserver: chunks 1-2 of the added table (chunk 1 read
    again, chunk 2 never read before) are one backfill, tagged with who and why, whose run succeeds; the window log
    then holds chunk 2 staged and reconciled, chunk 1 twice, and the mirror still equals the source. A chunk the
    table does not have, or a table that is not captured, is refused naming it, and launches nothing."""
    before = set(backfill_ids(dagster_ui))
    refused = run_backfill_cli(dagster_ui, "--table", "public.refunds", "--chunks", "2-3")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "chunk-000003 is not a planned chunk of public.refunds (source 'demo')" in refused.stderr
    assert "its 3 chunks are chunk-000000...chunk-000002" in refused.stderr
    refused = run_backfill_cli(dagster_ui, "--table", "public.nowhere", "--chunks", "0")
    assert refused.returncode == 1 and "has no asset demo/public/nowhere for table public.nowhere" in refused.stderr
    assert set(backfill_ids(dagster_ui)) == before  # nothing launched

    reason = "chunks 1-2 again from the command line"
    launched = run_backfill_cli(
        dagster_ui, "--table", "public.refunds", "--chunks", "1-2", "--requested-by", "operator", "--reason", reason
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr
    answer = json.loads(launched.stdout)
    assert answer["asset"] == f"{SOURCE}/public/refunds"
    assert answer["chunks"] == [chunk_partition_key(1), chunk_partition_key(2)]
    assert set(backfill_ids(dagster_ui)) == before | {answer["backfill_id"]}
    status = wait_for_backfill(page, dagster_ui, answer["backfill_id"])  # the page the command printed
    assert answer["url"] == f"{dagster_ui.url}/runs/b/{answer['backfill_id']}"
    screenshot(page, "2-added-table-cli-backfill")
    expect(status).to_have_text("Succeeded")
    (run,) = backfill_runs(dagster_ui, answer["backfill_id"])  # both chunks in one run (chunks_per_run: 10)
    assert run.tags[REQUESTED_BY_TAG] == "operator" and run.tags[REASON_TAG] == reason
    done = materialized_partitions(dagster_ui, AssetKey([SOURCE, "public", "refunds"]))
    assert done == Counter({chunk_partition_key(0): 1, chunk_partition_key(1): 2, chunk_partition_key(2): 1}), done

    lake = SourceLake(dagster_ui.lake, SOURCE)
    events = [e for e in read_events(spark, lake.windows) if e.window.table == "public.refunds"]
    assert Counter(e.window.chunk for e in events if e.event == STAGED) == Counter({0: 1, 1: 2, 2: 1})
    reconciled = Counter(e.window.chunk for e in events if e.event == RECONCILED)
    assert reconciled == Counter({0: 1, 1: 2, 2: 1}), reconciled
    source, table = captured(dagster_ui, "public.refunds")
    assert mirror_rows(spark, lake.table("public.refunds").mirror, table) == source_rows(source, table)


def backfill_runs(ui: DagsterUi, backfill_id: str) -> list:
    with ui.instance() as instance:
        return list(instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: backfill_id})))


def backfill_ids(ui: DagsterUi) -> list[str]:
    with ui.instance() as instance:
        return [b.backfill_id for b in instance.get_backfills(limit=50)]


def materialized_partitions(ui: DagsterUi, asset_key: AssetKey) -> Counter[str]:
    """How many times each partition of the asset was materialized."""
    with ui.instance() as instance:
        records = instance.fetch_materializations(asset_key, limit=1000).records
    return Counter(r.asset_materialization.partition for r in records if r.asset_materialization is not None)


def choose_backfill_action(page: Page, action: str) -> None:
    """On a backfill's page: the actions menu (the button beside its title), then ``action``."""
    page.get_by_role("button").filter(has=page.get_by_role("img", name="expand_more")).first.click()
    page.get_by_role("menuitem", name=action).click()


def wait_for(what: str, probe: Callable[[], T], timeout_seconds: float) -> T:
    return support_wait_for(what, probe, timeout_seconds, poll_seconds=2)


@contextmanager
def stream_held(ui: DagsterUi) -> Iterator[None]:
    """The stream run in flight stopped (SIGSTOP) for the block, resumed (SIGCONT) after it: the stream of a source
    that is slow to pass a window, held on purpose. Its process keeps its SQL session and pool slot; it peeks the
    slot with SQL functions (no replication connection that a ``wal_sender_timeout`` would end)."""
    with ui.instance() as instance:
        in_flight = RunsFilter(job_name=stream_job_name(SOURCE), statuses=[DagsterRunStatus.STARTED])
        run = wait_for("a stream run in flight", lambda: instance.get_run_records(in_flight, limit=1), 300)[0]
        pid = wait_for("its pid", lambda: run_pid(instance, run.dagster_run.run_id), 60)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_twenty_chunk_snapshot_paused_from_the_ui_resumes_with_only_the_chunks_not_done(
    dagster_ui: DagsterUi, page: Page, spark: SparkSession
) -> None:
    """Pause and resume of a long snapshot (Debezium's pause-snapshot and resume-snapshot): a backfill of all 20
    chunks of order_lines (10 chunks a run, a backfill's runs one at a time) is cancelled from the UI once its first
    run's snapshot step materialized its chunks; the first run is cancelled in its check step, the second, queued
    behind it, never reads. "Re-execute from failure" then launches a backfill of the 10 chunks not materialized.
    Every chunk is materialized exactly once, the first run's chunks are never read again, the stream records
    batches again once let go, and the mirror equals the source.

    The stream is held (``stream_held``) from the launch until the backfill is cancelled. The first run's check
    step waits for the stream to pass its chunks' windows, so that run is still in flight when the backfill daemon
    acts on the cancel: the UI's "Cancel backfill" only marks the backfill canceling, and the daemon cancels its
    runs at its next iteration (every 30 s). Without the hold, a CI run's first run ended and the second read all
    its chunks before the daemon acted (20 chunks materialized, not 10)."""
    name, asset_key = "public.order_lines", AssetKey([SOURCE, "public", "order_lines"])
    page.goto(f"{dagster_ui.url}/assets/{SOURCE}/public/order_lines?view=partitions")
    wait_until_shown(page, page.get_by_text("Missing (20)", exact=True), PLANNER_TIMEOUT_MS)
    stream_before = latest_offset_event(dagster_ui)
    known = set(backfill_ids(dagster_ui))
    with stream_held(dagster_ui):
        first = launch_backfill(page, lambda dialog: dialog.get_by_role("button", name="All", exact=True).click(), 20)
        # pause once the first run's snapshot step has materialized its 10 chunks (its check step then waits for
        # the held stream, and the second run waits for it: one run of a backfill at a time)
        page.goto(f"{dagster_ui.url}/runs/b/{first}")
        deadline = time.monotonic() + BACKFILL_TIMEOUT_MS / 1000
        while len(materialized_partitions(dagster_ui, asset_key)) < 10:
            assert time.monotonic() < deadline, f"backfill {first} materialized no chunk"
            assert not any(r.status == DagsterRunStatus.FAILURE for r in backfill_runs(dagster_ui, first))
            time.sleep(1)
        choose_backfill_action(page, "Cancel backfill")
        page.get_by_role("dialog").get_by_role("button", name="Cancel backfill").click()
        status = wait_for_backfill(page, dagster_ui, first)
        expect(status).to_have_text("Canceled")
        screenshot(page, "3-snapshot-paused")
        paused = materialized_partitions(dagster_ui, asset_key)
        statuses = [r.status.value for r in backfill_runs(dagster_ui, first)]
    assert len(paused) == 10 and set(paused.values()) == {1}, paused  # the first run's chunks, nothing else
    # the first run cancelled in its check step, the second cancelled before it started
    assert statuses == ["CANCELED", "CANCELED"], statuses

    page.goto(f"{dagster_ui.url}/runs/b/{first}")
    choose_backfill_action(page, "Re-execute from failure")
    deadline = time.monotonic() + RUN_TIMEOUT_MS / 1000
    while not (resumed := set(backfill_ids(dagster_ui)) - known - {first}):
        assert time.monotonic() < deadline, "Re-execute from failure launched no backfill"
        time.sleep(1)
    (second,) = resumed
    status = wait_for_backfill(page, dagster_ui, second)
    screenshot(page, "3-snapshot-resumed")
    expect(status).to_have_text("Succeeded")
    assert len(backfill_runs(dagster_ui, second)) == 1  # the 10 chunks not done, in one run

    chunks = {chunk_partition_key(i) for i in range(20)}
    done = materialized_partitions(dagster_ui, asset_key)
    assert set(done) == chunks and set(done.values()) == {1}, done  # every chunk materialized exactly once
    lake = SourceLake(dagster_ui.lake, SOURCE)
    events = [e for e in read_events(spark, lake.windows) if e.window.table == name]
    staged = Counter(e.window.chunk for e in events if e.event == STAGED)
    first_run_chunks = {chunk_index(key) for key in paused}
    assert all(staged[i] == 1 for i in first_run_chunks), staged  # never read again after the pause
    assert {e.window.chunk for e in events if e.event == RECONCILED} == set(range(20))
    assert latest_offset_event(dagster_ui) != stream_before  # the stream recorded batches once let go
    source, table = captured(dagster_ui, name)
    expected = source_rows(source, table)
    assert len(expected) == 600
    assert mirror_rows(spark, lake.table(name).mirror, table) == expected


def test_the_stream_asset_plots_its_lag_and_its_lag_check_says_within_bounds(dagster_ui: DagsterUi, page: Page) -> None:
    page.goto(f"{dagster_ui.url}/assets/{SOURCE}/_stream")
    page.get_by_role("button", name="Plots").click()
    for metric in ("lag_bytes", "lag_seconds"):
        title = page.get_by_text(metric, exact=True)
        canvas = page.locator("div").filter(has=title).filter(has=page.locator("canvas")).last.locator("canvas")
        expect(canvas).to_be_visible()
        # drawn: points in colour (an empty plot has none)
        page.wait_for_function(f"canvas => ({COLOURED_PIXELS})(canvas) > 0", arg=canvas.element_handle())
    page.get_by_text("lag_bytes", exact=True).scroll_into_view_if_needed()
    screenshot(page, "4-stream-lag-plots")

    page.get_by_role("tab", name="Checks").click()
    expect(page.get_by_text("lag_within_bound").first).to_be_visible()
    within = re.compile(rf"^stream of source '{SOURCE}' lags \d+ bytes, \d+ s: within bounds$")
    expect(page.get_by_text(within)).to_be_visible()
    expect(page.get_by_text("Passed", exact=True)).to_be_visible()
    screenshot(page, "4-stream-lag-check")

    instance = dagster_ui.instance()
    try:  # what the plots draw: the streaming sensor's observation of the lag on every tick
        observations = instance.fetch_observations(stream_asset_key(SOURCE), limit=100).records
    finally:
        instance.dispose()
    lags = [r.asset_observation.metadata for r in observations if r.asset_observation is not None]
    assert len(lags) >= 3 and all({"lag_bytes", "lag_seconds"} <= set(m) for m in lags), lags[:3]


def test_a_stream_run_killed_by_sigkill_fails_and_the_next_one_gets_its_pool_slot(
    dagster_ui: DagsterUi, page: Page, spark: SparkSession
) -> None:
    """A stream run's process killed (the OS's OOM killer, an operator): run monitoring marks the run failed, and
    what its step held in the source's lake-write pool is freed soon after (``free_slots_after_run_end_seconds``
    in ``dagster_home/dagster.yaml``: a minute there, 10 s here, ``RUN_MONITORING``), so the next stream run the
    sensor requests starts and a change written after the kill reaches the mirror. Without that setting the next
    run stayed queued for good (a demo's stream stood still until its slot was freed by hand)."""
    job = stream_job_name(SOURCE)
    with dagster_ui.admin() as admin:  # work for the stream, so that its sensor requests a run if none is in flight
        admin.execute("update orders set status = 'before the kill' where id = (select max(id) from orders)")
    with dagster_ui.instance() as instance:
        in_flight = RunsFilter(job_name=job, statuses=[DagsterRunStatus.STARTED])
        record = wait_for("a stream run in flight", lambda: instance.get_run_records(in_flight, limit=1), 300)[0]
        killed = record.dagster_run
        pid = wait_for("its pid", lambda: run_pid(instance, killed.run_id), 60)
        os.kill(pid, signal.SIGKILL)
        with dagster_ui.admin() as admin:
            key = admin.execute("update orders set status = 'after the kill' where id = (select min(id) from orders)"
                                " returning id").fetchone()[0]  # fmt: skip
        wait_for("the killed run marked failed",
                 lambda: instance.get_run_by_id(killed.run_id).status == DagsterRunStatus.FAILURE, 180)  # fmt: skip
        after = RunsFilter(job_name=job, statuses=[DagsterRunStatus.STARTED], created_after=record.create_timestamp)
        successor = wait_for(
            "the next stream run started",
            lambda: [r for r in instance.get_runs(after, limit=5) if r.run_id != killed.run_id],
            300,
        )

        def slot_freed() -> bool:  # the next run may start first: its warm-up then waits for this slot
            pool = instance.event_log_storage.get_concurrency_info(f"cdc_lake_writes_{SOURCE}")
            return killed.run_id not in {slot.run_id for slot in pool.claimed_slots}

        wait_for("the killed run's slot in the lake-write pool freed", slot_freed, 120)
    page.goto(f"{dagster_ui.url}/runs/{killed.run_id}")
    expect(page.get_by_text(re.compile(r"terminated by signal 9 \(SIGKILL\)")).first).to_be_visible(
        timeout=UI_TIMEOUT_MS
    )
    screenshot(page, "5-stream-run-killed")
    lake = SourceLake(dagster_ui.lake, SOURCE)

    def mirrored() -> bool:
        mirror = lake.table("public.orders").mirror
        if not DeltaTable.isDeltaTable(spark, mirror):  # the stream's first batch of it creates it (latest mode)
            return False
        rows = spark.read.format("delta").load(mirror).where(f"id = {key}")
        return [r["status"] for r in rows.collect()] == ["after the kill"]

    wait_for(f"the change after the kill in the mirror (run {successor[0].run_id})", mirrored, 300)
