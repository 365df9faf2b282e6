"""The MongoDB servers of the tests: the wire-protocol test server (mongo-java-server 1.47.0, in memory, oplog enabled;
``docs/mongodb.md``) started as a child process on a free loopback port, and a real replica set named by the
environment.

Contract:

- ``start_mongo_test_server(log_dir, port=0)`` runs ``java -cp <jars>/* cdclake.MongoTestServer 127.0.0.1 PORT``
  (the launcher ``scripts/setup.sh`` builds into ``.jars/mongo-test-server/``, or
  ``$CDC_JARS_DIR/mongo-test-server/``; port 0: a free one), reads the bound port from its ``listening HOST:PORT``
  line, waits until it answers ``ping`` and returns a ``MongoTestServer``; the server's stderr goes to a log file in
  ``log_dir``. A missing ``java`` or jar, a server that exits or does not answer: ``MongoTestServerError`` (the tests
  fail; they never skip for it).
- ``MongoTestServer.stop()`` sends SIGTERM (the launcher's shutdown hook closes the server) and waits; idempotent;
  the log stays only when the server ended otherwise.
- ``real_mongodb_uri()`` is ``$CDC_TEST_MONGODB_URI`` (a real replica set, or ``mongos``), or None when unset.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pymongo
from pymongo.errors import PyMongoError

ROOT = Path(__file__).resolve().parents[2]
REAL_MONGODB_URI_ENV = "CDC_TEST_MONGODB_URI"
LAUNCHER_CLASS = "cdclake.MongoTestServer"
LISTENING = re.compile(r"^listening (?P<host>\S+):(?P<port>\d+)$")


class MongoTestServerError(RuntimeError):
    """The MongoDB test server could not be started (or stopped)."""


def launcher_jars() -> Path:
    """The folder of the launcher jar and its dependencies."""
    return Path(os.environ.get("CDC_JARS_DIR", ROOT / ".jars")) / "mongo-test-server"


@dataclass
class MongoTestServer:
    """A running test server process."""

    process: subprocess.Popen[str]
    host: str
    port: int
    log_path: Path

    @property
    def uri(self) -> str:
        """The connection string: a single server, so a direct connection."""
        return f"mongodb://{self.host}:{self.port}/?directConnection=true"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL (and ``MongoTestServerError``). The log is removed
        when the server stopped on SIGTERM, kept otherwise."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise MongoTestServerError(
                    f"the mongo test server (pid {self.process.pid}) ignored SIGTERM for {timeout} s; killed"
                ) from None
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.process.returncode in (143, -15):  # the JVM's exit on SIGTERM
            self.log_path.unlink(missing_ok=True)


def start_mongo_test_server(
    log_dir: Path, timeout: float = 60.0, port: int = 0, data_file: Path | None = None
) -> MongoTestServer:
    """Start the launcher on loopback ``port`` (0: a free one) and wait until it answers ``ping`` (see the module
    docstring). ``data_file``: the H2 backend in that file (the demo's server), else the memory backend."""
    java = shutil.which("java")
    if java is None:
        raise MongoTestServerError("no `java` on PATH: the MongoDB test server needs Java 17 (scripts/setup.sh)")
    jars = launcher_jars()
    if not (jars / "mongo-test-server.jar").is_file():
        raise MongoTestServerError(
            f"no MongoDB test server jar in {jars}: run scripts/setup.sh (Maven builds jvm/mongo-test-server)"
        )
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{os.getpid()}-{time.time_ns()}.log"
    backend = [str(data_file)] if data_file else []
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [java, "-cp", f"{jars}/*", LAUNCHER_CLASS, "127.0.0.1", str(port), *backend],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        host, port = _read_listening_line(process, log_path, time.monotonic() + timeout)
        server = MongoTestServer(process, host, port, log_path)
        _wait_for_ping(server, time.monotonic() + timeout)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return server


def _read_listening_line(process: subprocess.Popen[str], log_path: Path, deadline: float) -> tuple[str, int]:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if selector.select(remaining):
                line = process.stdout.readline()
                if not line:  # end of output: the process ended
                    break
                match = LISTENING.match(line.strip())
                if match:
                    return match["host"], int(match["port"])
    code = process.poll()
    state = f"exited with code {code}" if code is not None else "printed no 'listening HOST:PORT' line in time"
    raise MongoTestServerError(f"the mongo test server {state}; its log {log_path}:\n{log_path.read_text()}")


def _wait_for_ping(server: MongoTestServer, deadline: float) -> None:
    while True:
        client: pymongo.MongoClient = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=1000)
        try:
            client.admin.command("ping")
            return
        except PyMongoError as error:
            if time.monotonic() > deadline or server.process.poll() is not None:
                raise MongoTestServerError(
                    f"the mongo test server on {server.uri} does not answer ping ({error}); log {server.log_path}"
                ) from error
        finally:
            client.close()
        time.sleep(0.1)


def real_mongodb_uri() -> str | None:
    """The real replica set the gated tests use (``$CDC_TEST_MONGODB_URI``), or None."""
    return os.environ.get(REAL_MONGODB_URI_ENV) or None
