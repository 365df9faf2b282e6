"""Shared fixtures: services are started once per test session by the project's own scripts."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.support import PG_PORT, PG_SOCKET

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[dict[str, str]]:
    """Start (or reuse) the project's private PostgreSQL cluster; never skip: a missing server is a failure.
    A cluster this session started is stopped at its end (one that was already running, e.g. the demo's, is left)."""
    pg = str(ROOT / "scripts" / "pg.sh")
    was_running = subprocess.run([pg, "status"], capture_output=True).returncode == 0
    subprocess.run([pg, "start"], check=True, capture_output=True, text=True)
    yield {"socket": PG_SOCKET, "port": str(PG_PORT)}
    if not was_running:
        subprocess.run([pg, "stop"], check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def spark():
    """One local Spark session with Delta for the whole test session."""
    from cdc_assets.config import SparkConfig
    from cdc_assets.lake.spark import spark_session

    session = spark_session(SparkConfig(master="local[2]"))
    yield session
    session.stop()
