"""Fixtures of the browser tests: ``dagster dev`` on a small demo database, and Debian's Chromium driven by Playwright.

One server and one browser for the whole session. The server is the demo's (``dagster dev`` with ``workspace.yaml``
and ``dagster_home/dagster.yaml``, its run monitor's waits shortened: ``RUN_MONITORING``) on a free port, over a
database that ``tools/demo_db.py setup --scale 0.01`` makes (200 customers, 500 orders, 600 order lines; chunks of
100 rows). The source starts in ``latest`` mode: the planner plans every table's chunks but snapshots none, so a
mirror holds exactly what the tests snapshot from the UI. Stream runs last ``run_seconds`` as in the demo (one Spark
driver for every batch).

Chromium is Debian's ``chromium`` package (``scripts/setup.sh`` installs it); Playwright drives that executable and
never downloads a browser. Without it the browser tests are skipped, saying so. Screenshots and the server's log
go to ``.artifacts/browser/`` (git-ignored), emptied when the session starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import Browser, Page, expect, sync_playwright

from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS
from tests.browser.ui_support import (
    ARTIFACTS,
    CHROMIUM,
    CONFIG,
    DATABASE,
    PASSWORD_ENV,
    ROOT,
    SOURCE,
    UI_TIMEOUT_MS,
    DagsterUi,
    screenshot,
)
from tests.integration.support import READER_PASSWORD, drop_source
from tools.spark_standalone import free_port

# the demo's instance (dagster_home/dagster.yaml) with its run monitor's waits shortened: a killed run is found
# within 5 s instead of 30, and what it held in a pool is freed 10 s after it ended instead of 60 (the killed stream
# run's test waited 90 s for the two, the machine idle)
RUN_MONITORING = {"poll_interval_seconds": 5, "free_slots_after_run_end_seconds": 10}


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    """Debian's Chromium; the browser tests are skipped, naming it, where it is not installed."""
    path = shutil.which(CHROMIUM)
    if path is None:
        pytest.skip(
            f"no `{CHROMIUM}` executable on PATH: install Debian's `{CHROMIUM}` package "
            f"(`apt-get install {CHROMIUM}`, as scripts/setup.sh does) to run the browser tests"
        )
    return path


@pytest.fixture(scope="module")
def browser(chromium_executable: str) -> Iterator[Browser]:
    expect.set_options(timeout=UI_TIMEOUT_MS)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_executable, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture()
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh page per test; its last view is saved as ``<test name>-last.png`` whatever the outcome."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.set_default_timeout(UI_TIMEOUT_MS)
    # the first visit of an instance asks to join the community: skip it whenever it shows
    tab.add_locator_handler(
        tab.get_by_text("Join the Dagster community"), lambda: tab.get_by_role("button", name="Skip").click()
    )
    try:
        yield tab
    finally:
        try:
            screenshot(tab, f"{request.node.name}-last")
        finally:
            context.close()


@pytest.fixture(scope="module")
def dagster_ui(
    chromium_executable: str, postgres_server: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DagsterUi]:
    """``dagster dev`` on the demo database, ready once its code location has loaded; stopped with every run it
    started (they are in its process group) once the browser tests are done (module scope: they are one module;
    "package" scope is the session's without an ``__init__.py``). Kept for the whole session, its sensors went on
    launching runs beside every later test (a suite 39 minutes long in CI)."""
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    drop_source(admin_dsn, DATABASE)  # a database and slot left by an interrupted session
    os.environ[PASSWORD_ENV] = READER_PASSWORD
    database_env = {
        **os.environ,
        "CDC_PG_SOCKET": postgres_server["socket"],
        "CDC_PG_PORT": postgres_server["port"],
        "CDC_DEMO_PASSWORD": READER_PASSWORD,
    }
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo_db.py"), "setup", "--database", DATABASE,
         "--role", f"{DATABASE}_reader", "--scale", "0.01"],
        env=database_env, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    base = tmp_path_factory.mktemp("browser")
    home = base / "dagster_home"
    home.mkdir()
    instance = yaml.safe_load((ROOT / "dagster_home" / "dagster.yaml").read_text())
    instance["run_monitoring"].update(RUN_MONITORING)
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance))
    lake = base / "lake"
    config = base / "cdc.yaml"
    config.write_text(
        CONFIG.format(
            lake=lake,
            source=SOURCE,
            port=postgres_server["port"],
            database=DATABASE,
            password_env=PASSWORD_ENV,
            driver_options=SHORT_LIVED_DRIVER_OPTIONS,
        )
    )
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "CDC_CONFIG": str(config),
        # the worktree's code, also in the processes dagster dev starts (code server, runs)
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    log_path = home / "dagster-dev.log"
    command = [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml",
               "-h", "127.0.0.1", "-p", str(port)]  # fmt: skip
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_code_location(f"http://127.0.0.1:{port}", server, log_path)
        yield DagsterUi(f"http://127.0.0.1:{port}", home, config, lake, admin_dsn)
    finally:
        stop_process_group(server)
        shutil.copy(log_path, ARTIFACTS / "dagster-dev.log")
        drop_source(admin_dsn, DATABASE)


def graphql(url: str, query: str) -> dict:
    request = urllib.request.Request(
        f"{url}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def wait_for_code_location(url: str, server: subprocess.Popen, log_path: Path, timeout: float = 300) -> None:
    """Wait until the webserver answers and the code location ``cdc_lake`` has loaded (a load error fails)."""
    query = "{ workspaceOrError { ... on Workspace { locationEntries { name locationOrLoadError { __typename } } } } }"
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"dagster dev exited: {log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"dagster dev did not load in {timeout} s: {log_path.read_text()[-4000:]}"
        try:
            entries = graphql(url, query)["data"]["workspaceOrError"]["locationEntries"]
        except (OSError, urllib.error.URLError, KeyError, TypeError):
            entries = []
        loaded = [e["locationOrLoadError"] for e in entries if e["locationOrLoadError"]]
        if entries and len(loaded) == len(entries):
            assert [e["__typename"] for e in loaded] == ["RepositoryLocation"], f"{entries}: {log_path.read_text()}"
            return
        time.sleep(1)


def stop_process_group(server: subprocess.Popen) -> None:
    """Interrupt ``dagster dev`` (it stops its webserver, daemon and code servers on SIGINT), then kill what is left
    of its process group: runs in flight and their Spark drivers."""
    group = server.pid  # start_new_session: the server leads its own group
    try:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=10)  # runs in flight are killed below either way (a suite run spent 51 s here)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group_alive(group):
            time.sleep(0.5)
    server.wait(timeout=30)


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
