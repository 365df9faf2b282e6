"""Shared pieces of the benchmark commands: the ``bench`` database, its read-only role, process sampling, workers,
result tables and plots.

Environment:
- ``CDC_PG_PORT`` (default 54329) and ``CDC_PG_SOCKET`` (default ``.state/pg/sock``): the project's private cluster
  (``scripts/pg.sh start``); the administrator is the ``postgres`` role over the unix socket.
- ``CDC_BENCH_PASSWORD``: password of the read-only role ``bench_reader`` (``REPLICATION``, ``SELECT``,
  ``default_transaction_read_only``), set on the role by every command. When unset, a random one is generated for
  the run (kept in this process's environment only, so the worker processes inherit it). It is never printed.

Only the database ``bench`` is touched, and in it only tables, publications and slots whose names start with
``bench``.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DATABASE = "bench"
READER = "bench_reader"
PASSWORD_ENV = "CDC_BENCH_PASSWORD"
RESULT_PREFIX = "BENCH_RESULT "
MB = 1024 * 1024

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------------------------
# PostgreSQL


def pg_port() -> int:
    return int(os.environ.get("CDC_PG_PORT", "54329"))


def pg_socket() -> str:
    return os.environ.get("CDC_PG_SOCKET", str(ROOT / ".state" / "pg" / "sock"))


class ClusterNotRunning(SystemExit):
    """No PostgreSQL answers where the bench looks for the project's cluster: the message says how to start it."""


def admin_connect(dbname: str = DATABASE) -> psycopg.Connection:
    """An autocommit administrator connection (``postgres`` over the unix socket). ``ClusterNotRunning`` (the
    command's exit message) when no server listens there: it names the socket, the port and how to start one."""
    try:
        return psycopg.connect(host=pg_socket(), port=pg_port(), user="postgres", dbname=dbname, autocommit=True)
    except psycopg.OperationalError as error:
        socket = Path(pg_socket()) / f".s.PGSQL.{pg_port()}"
        if socket.exists():
            raise
        raise ClusterNotRunning(
            f"bench: no PostgreSQL server listens on {socket} (CDC_PG_SOCKET, CDC_PG_PORT): start the project's "
            "cluster first with `scripts/pg.sh start` (docs/benchmarks.md)"
        ) from error


def reader_password() -> str:
    """The reader role's password from the environment; generated (and exported to workers) when unset."""
    value = os.environ.get(PASSWORD_ENV)
    if not value:
        value = secrets.token_urlsafe(18)
        os.environ[PASSWORD_ENV] = value
    return value


def reader_dsn_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` as the reader over TCP (holds the password: never print)."""
    return {"host": "127.0.0.1", "port": pg_port(), "dbname": DATABASE, "user": READER, "password": reader_password()}


def ensure_database() -> None:
    """Create database ``bench`` (if missing) and the role ``bench_reader`` with the environment's password."""
    password = reader_password()
    with admin_connect("postgres") as root:
        exists = root.execute("select 1 from pg_database where datname = %s", [DATABASE]).fetchone()
        for attempt in range(10):
            if exists:
                break
            try:
                root.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
                break
            except psycopg.errors.ObjectInUse:  # template1 briefly in use by a concurrent creator
                time.sleep(1 + attempt)
        role = root.execute("select 1 from pg_roles where rolname = %s", [READER]).fetchone()
        verb = "alter" if role else "create"
        root.execute(
            sql.SQL(verb + " role {} login replication password {}").format(
                sql.Identifier(READER), sql.Literal(password)
            )
        )
        root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(READER)))


def grant_select(conn: psycopg.Connection, table: str) -> None:
    conn.execute(sql.SQL("grant select on {} to {}").format(sql.Identifier(table), sql.Identifier(READER)))


def reset_capture(conn: psycopg.Connection, name: str, tables: Sequence[str]) -> None:
    """(Re)create publication ``name`` for ``tables`` and the pgoutput slot ``name`` (administrator, beforehand)."""
    drop_capture(conn, name)
    conn.execute(
        sql.SQL("create publication {} for table {}").format(
            sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(t) for t in tables)
        )
    )
    conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [name])


def drop_capture(conn: psycopg.Connection, name: str) -> None:
    """Drop the slot and publication ``name`` (slots would keep WAL for the whole cluster)."""
    assert name.startswith("bench"), name
    for _ in range(30):
        row = conn.execute("select active_pid from pg_replication_slots where slot_name = %s", [name]).fetchone()
        if row is None:
            break
        if row[0] is not None:
            time.sleep(1)
            continue
        conn.execute("select pg_drop_replication_slot(%s)", [name])
        break
    conn.execute(sql.SQL("drop publication if exists {}").format(sql.Identifier(name)))


def drop_slot(conn: psycopg.Connection, name: str) -> None:
    assert name.startswith("bench"), name
    if conn.execute("select 1 from pg_replication_slots where slot_name = %s", [name]).fetchone():
        conn.execute("select pg_drop_replication_slot(%s)", [name])


def postmaster_pid() -> int | None:
    data = Path(os.environ.get("CDC_PG_STATE", ROOT / ".state" / "pg")) / "data" / "postmaster.pid"
    try:
        return int(data.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wal_bytes(conn: psycopg.Connection, since: str) -> int:
    (value,) = conn.execute(
        "select pg_wal_lsn_diff(pg_current_wal_flush_lsn(), %s::pg_lsn)::bigint", [since]
    ).fetchone()
    return int(value)


# ---------------------------------------------------------------------------------------------------------------
# Pipeline configuration (the lead's API: cdc_assets.config)


def pipeline_config(
    source_name: str,
    lake_root: Path,
    tables: Sequence[str],
    chunk_size: int,
    max_changes: int | None = None,
    spill_rows: int = 50_000,
    read_parallelism: int = 2,
    spark_conf: dict[str, str] | None = None,
    spark_master: str = "local[2]",
) -> Any:
    """A ``CdcConfig`` with one PostgreSQL source ``source_name`` (slot and publication of the same name); the batch
    bound ``max_changes`` is the source default (``StreamConfig``) unless given."""
    from cdc_assets.config import (
        CdcConfig,
        PostgresConnection,
        Secret,
        SourceConfig,
        SparkConfig,
        StreamConfig,
        TableConfig,
    )

    source = SourceConfig(
        name=source_name,
        kind="postgres",
        connection=PostgresConnection("127.0.0.1", pg_port(), DATABASE, READER, Secret(reader_password())),
        slot=source_name,
        publication=source_name,
        startup_mode="initial",
        chunk_size=chunk_size,
        read_parallelism=read_parallelism,
        tables=tuple(TableConfig(schema="public", name=t) for t in tables),
        include=(),
        exclude=(),
        stream=StreamConfig(
            max_changes=StreamConfig.max_changes if max_changes is None else max_changes, spill_rows=spill_rows
        ),
    )
    return CdcConfig(
        lake_root=lake_root, spark=SparkConfig(master=spark_master, conf=dict(spark_conf or {})), sources=(source,)
    )


def parse_lsn_text(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


# ---------------------------------------------------------------------------------------------------------------
# Process sampling


def _cpu(times: Any) -> float:
    return float(times.user + times.system)


@dataclass
class RoleUsage:
    """Peak RSS (sum over the role's processes at one sample) and CPU seconds of one kind of process."""

    peak_rss: int = 0
    cpu_seconds: float = 0.0
    processes: int = 0


@dataclass
class Sampler:
    """Samples a process tree (and the PostgreSQL backends serving database ``bench``) every ``interval`` seconds.

    Roles: ``driver`` (the root process), ``jvm`` (descendant ``java`` processes: the Spark driver JVM),
    ``py_workers`` (other descendant Python processes: Spark's Python workers), ``other`` (any other descendant),
    ``pg_backends`` (server processes of database ``bench`` whose role is in ``pg_users``). CPU seconds of a process
    are its last sampled user+system time, minus its time at the first sample when it existed before sampling
    started; a process that ends between two samples loses at most one interval of CPU. Peak RSS is sampled; when the
    root is this process, its CPU comes from ``getrusage`` and (``lifetime_peak``) its peak RSS too (the process's
    lifetime peak, exact).
    """

    root_pid: int
    interval: float = 0.2
    pg_users: tuple[str, ...] = (READER,)
    lifetime_peak: bool = True
    series: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _cpu_by_pid: dict[int, tuple[str, float]] = field(default_factory=dict)
    _baseline: dict[int, float] = field(default_factory=dict)
    _peak: dict[str, int] = field(default_factory=dict)
    _pids: dict[str, set[int]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _procs: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = 0.0

    def __post_init__(self) -> None:
        self._postmaster = postmaster_pid()

    def start(self) -> Sampler:
        self.started = time.monotonic()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _process(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                return None
            self._procs[pid] = proc
        return proc

    def _tree(self) -> list[tuple[str, psutil.Process]]:
        found: list[tuple[str, psutil.Process]] = []
        root = self._process(self.root_pid)
        if root is None:
            return found
        found.append(("driver", root))
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            proc = self._process(child.pid) or child
            try:
                name = proc.name()
            except psutil.Error:
                continue
            if name == "java":
                role = "jvm"
            elif name.startswith("python"):
                role = "py_workers"
            else:
                role = "other"
            found.append((role, proc))
        if self._postmaster is not None:
            master = self._process(self._postmaster)
            try:
                backends = master.children() if master is not None else []
            except psutil.Error:
                backends = []
            for backend in backends:
                proc = self._process(backend.pid) or backend
                try:
                    words = proc.cmdline()
                except psutil.Error:
                    continue
                # "postgres: <user> <database> <host(port)> <activity>"
                parts = " ".join(words).split()
                if len(parts) >= 3 and parts[0] == "postgres:" and parts[2] == DATABASE and parts[1] in self.pg_users:
                    found.append(("pg_backends", proc))
        return found

    def _sample(self, first: bool = False) -> None:
        now = time.monotonic() - self.started
        rss: dict[str, int] = {}
        for role, proc in self._tree():
            try:
                with proc.oneshot():
                    memory = proc.memory_info().rss
                    cpu = _cpu(proc.cpu_times())
            except psutil.Error:
                continue
            if first:
                self._baseline[proc.pid] = cpu
            self._cpu_by_pid[proc.pid] = (role, cpu)
            self._pids.setdefault(role, set()).add(proc.pid)
            rss[role] = rss.get(role, 0) + memory
        for role, value in rss.items():
            self._peak[role] = max(self._peak.get(role, 0), value)
        self.series.append((now, rss))

    def finish(self) -> dict[str, RoleUsage]:
        """Stop sampling (after one last sample) and return usage per role."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        usage: dict[str, RoleUsage] = {}
        for pid, (role, cpu) in self._cpu_by_pid.items():
            item = usage.setdefault(role, RoleUsage())
            item.cpu_seconds += cpu - self._baseline.get(pid, 0.0)
        for role, pids in self._pids.items():
            item = usage.setdefault(role, RoleUsage())
            item.processes = len(pids)
            item.peak_rss = self._peak.get(role, 0)
        if self.root_pid == os.getpid() and "driver" in usage:
            own = resource.getrusage(resource.RUSAGE_SELF)
            if self.lifetime_peak:
                usage["driver"].peak_rss = max(usage["driver"].peak_rss, own.ru_maxrss * 1024)
            usage["driver"].cpu_seconds = own.ru_utime + own.ru_stime - self._baseline.get(self.root_pid, 0.0)
        return usage

    def series_mb(self, role: str) -> tuple[list[float], list[float]]:
        xs = [t for t, _ in self.series]
        ys = [values.get(role, 0) / MB for _, values in self.series]
        return xs, ys


def usage_json(usage: dict[str, RoleUsage]) -> dict[str, dict[str, float]]:
    return {
        role: {
            "peak_rss_mb": round(u.peak_rss / MB, 1),
            "cpu_seconds": round(u.cpu_seconds, 2),
            "processes": u.processes,
        }
        for role, u in sorted(usage.items())
    }


# ---------------------------------------------------------------------------------------------------------------
# Workers: a benchmark step in its own process, reporting one JSON result line


def emit_result(result: dict[str, Any]) -> None:
    """Print a worker's result (the parent reads the last line starting with ``RESULT_PREFIX``)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()


def run_worker(module: str, args: Sequence[str], log_name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module args`` (cwd = repository root), its output into ``bench/out/logs/<log_name>.log``;
    return the worker's result dictionary. A failing worker raises with the log's tail."""
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{log_name}.log"
    command = [sys.executable, "-m", module, *args]
    with open(log_path, "w") as log:
        completed = subprocess.run(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})}
        )
    result = None
    with open(log_path, "a") as log:
        for line in completed.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
            else:
                log.write(line + "\n")
    if completed.returncode != 0 or result is None:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(
            f"worker {module} {' '.join(args)} failed (exit {completed.returncode}); log {log_path}:\n{tail}"
        )
    return result


def start_worker(module: str, args: Sequence[str], log_name: str) -> tuple[subprocess.Popen[str], Path]:
    """Start ``python -m module args`` in the background; stdout and stderr into ``bench/out/logs/<log_name>.log``."""
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{log_name}.log"
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=log, stderr=log, text=True)
    return process, log_path


def worker_result(log_path: Path) -> dict[str, Any] | None:
    result = None
    for line in log_path.read_text().splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    return result


# ---------------------------------------------------------------------------------------------------------------
# Output


def machine() -> str:
    memory = psutil.virtual_memory().total / 1024**3
    return f"{os.cpu_count()} cores, {memory:.0f} GiB RAM, {sys.platform}, Python {sys.version.split()[0]}"


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Print (and return) a plain text table."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(row, widths, strict=True)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").replace("x", "").isdigit()


def save_json(name: str, payload: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT / f"{name}-{stamp}.json"
    path.write_text(json.dumps({"machine": machine(), "utc": stamp, **payload}, indent=2, default=str))
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def fresh_dir(prefix: str) -> Path:
    """A fresh empty directory under ``bench/out/work`` (removed by ``remove_dir``)."""
    base = OUT / "work"
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{prefix}-{os.getpid()}-{int(time.time())}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class JvmClock:
    """What a Spark driver JVM has spent so far besides its own work: ``compile_seconds``, the JIT compilers' time
    (summed over the compiler threads, so it may pass wall time: on 2 cores they compete with Spark's tasks), and
    ``gc_seconds``, the collectors' time. Subtract two readings for what happened in between."""

    compile_seconds: float
    gc_seconds: float

    def __sub__(self, earlier: JvmClock) -> JvmClock:
        return JvmClock(self.compile_seconds - earlier.compile_seconds, self.gc_seconds - earlier.gc_seconds)

    def to_json(self) -> dict[str, float]:
        return {"compile_seconds": round(self.compile_seconds, 3), "gc_seconds": round(self.gc_seconds, 3)}


def jvm_clock(spark: Any) -> JvmClock | None:
    """The driver JVM's ``JvmClock`` now, read through the session's gateway (``java.lang.management``); None without
    a local JVM (Spark Connect)."""
    jvm = getattr(spark, "_jvm", None)
    if jvm is None:
        return None
    management = jvm.java.lang.management.ManagementFactory
    gc_ms = sum(max(0, bean.getCollectionTime()) for bean in management.getGarbageCollectorMXBeans())
    return JvmClock(management.getCompilationMXBean().getTotalCompilationTime() / 1000, gc_ms / 1000)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    value = fn()
    return value, time.monotonic() - started


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
