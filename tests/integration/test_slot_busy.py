"""One session at a time on a replication slot: PostgreSQL refuses a peek while another session uses the slot. The
streaming sensor's lag probe and a long-lived stream run's poll met there in the browser test (the run's step
failed, "replication slot ... is active for PID ...", and was retried with a new Spark driver); a peek now waits for
the slot (``cdc_assets.sources.postgres.stream.when_slot_free``), for a bounded time."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc_assets.sources.postgres import stream
from tests.integration.support import create_source, drop_source

DATABASE = "pipe_slot_busy"
PEEK = "select 1 from pg_logical_slot_peek_binary_changes(%s, null, 1, 'proto_version', '1', 'publication_names', %s)"


def pg_recvlogical() -> str:
    installed = Path("/usr/lib/postgresql/15/bin/pg_recvlogical")
    found = str(installed) if installed.exists() else shutil.which("pg_recvlogical")
    assert found, "pg_recvlogical (package postgresql-client-15) is missing"
    return found


@pytest.fixture()
def admin(postgres_server: dict[str, str]) -> Iterator[psycopg.Connection]:
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, DATABASE)  # slot and publication named after the database
    conn = psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True)
    conn.execute("set synchronous_commit = on")  # a commit is flushed, so a peek sees it
    try:
        yield conn
    finally:
        conn.close()
        drop_source(admin_dsn, DATABASE)


def hold_slot(postgres_server: dict[str, str]) -> subprocess.Popen:
    """A replication session that keeps the slot in use (``pg_recvlogical --start``) until it is terminated."""
    command = [pg_recvlogical(), "-h", postgres_server["socket"], "-p", postgres_server["port"], "-U", "postgres",
               "-d", DATABASE, "-S", DATABASE, "--start", "--no-loop", "-f", "/dev/null",
               "-o", "proto_version=1", "-o", f"publication_names={DATABASE}"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until_in_use(conn: psycopg.Connection, holder: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        (pid,) = conn.execute("select active_pid from pg_replication_slots where slot_name = %s", [DATABASE]).fetchone()
        if pid is not None:
            return
        assert holder.poll() is None, holder.stderr.read() if holder.stderr else holder.returncode
        assert time.monotonic() < deadline, "pg_recvlogical never took the slot"
        time.sleep(0.1)


def test_a_peek_waits_while_another_session_uses_the_slot(
    admin: psycopg.Connection, postgres_server: dict[str, str]
) -> None:
    holder = hold_slot(postgres_server)
    try:
        wait_until_in_use(admin, holder)
        with pytest.raises(psycopg.errors.ObjectInUse, match="is active for PID"):
            admin.execute(PEEK, [DATABASE, DATABASE]).fetchone()  # what the probes met
        started = time.monotonic()
        with pytest.raises(psycopg.errors.ObjectInUse):  # the wait is bounded
            stream.when_slot_free(lambda: admin.execute(PEEK, [DATABASE, DATABASE]).fetchone(), seconds=1.0)
        assert 1.0 <= time.monotonic() - started < 10
        release = threading.Timer(2.0, holder.terminate)
        release.start()
        started = time.monotonic()
        assert stream.has_pending_changes(admin, DATABASE, DATABASE) is False  # waited for the slot, then peeked
        assert time.monotonic() - started >= 1.5
        release.join()
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    admin.execute("insert into pairs values (1, 'a', 1, 'x')")
    assert stream.has_pending_changes(admin, DATABASE, DATABASE) is True
    assert stream.oldest_pending_commit(admin, DATABASE, DATABASE) is not None
