"""What the browser tests and their fixtures share: the demo database's names, the source's configuration, the
running server (``DagsterUi``) and screenshots under ``.artifacts/browser/``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg
from dagster import DagsterInstance
from dagster._core.instance.ref import InstanceRef
from playwright.sync_api import Page

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".artifacts" / "browser"
DATABASE = "browser_demo"
SOURCE = "demo"
PASSWORD_ENV = "CDC_BROWSER_PASSWORD"
CHROMIUM = "chromium"
# what a user waits for, generously: the machine may be shared (a snapshot run starts a Spark driver)
UI_TIMEOUT_MS = 60_000
CONFIG = """
lake_root: {lake}
spark:
  master: local[2]
  # every run's driver lives seconds to minutes (cdc_assets.lake.spark.SHORT_LIVED_DRIVER_OPTIONS)
  conf: {{spark.sql.shuffle.partitions: "2", spark.driver.memory: 1g, spark.ui.enabled: "false",
         spark.driver.extraJavaOptions: "{driver_options}"}}
sources:
  - name: {source}
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader,
                 password: "${{{password_env}}}"}}
    slot: {database}
    publication: cdc_demo
    startup_mode: latest
    chunk_size: 100
    chunks_per_run: 10
    planner_interval_seconds: 5  # a table added at the source is planned within seconds of "Reload definitions"
    include: ["public.*"]
    tables: [{{name: public.order_lines, chunk_size: 30}}]  # 600 rows: the 20-chunk snapshot paused and resumed
    # a stream run keeps its Spark driver for 10 minutes, as in the demo; an idle slot is never advanced (no stream
    # run starts before a test writes)
    stream: {{interval_seconds: 5, run_seconds: 600, poll_seconds: 1, max_lag_bytes: 1099511627776}}
    checks: {{cron: "off"}}
"""


@dataclass(frozen=True)
class DagsterUi:
    """The running server: its address, instance folder, configuration and lake, and the source's administrator."""

    url: str
    home: Path
    config: Path
    lake: Path
    admin_dsn: str

    def instance(self) -> DagsterInstance:
        """The server's instance, read from the test (close it with ``dispose``)."""
        return DagsterInstance.from_ref(InstanceRef.from_dir(str(self.home)))

    def admin(self) -> psycopg.Connection:
        """An autocommit administrator connection to the source database."""
        return psycopg.connect(f"{self.admin_dsn} dbname={DATABASE}", autocommit=True)


def screenshot(page: Page, name: str) -> Path:
    """Save the page under ``.artifacts/browser/<name>.png``."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
