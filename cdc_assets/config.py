"""The project's configuration file (``cdc.yaml``): sources, captured tables, chunking, streaming, lake, Spark.

Contract: ``load_config(path)`` returns a validated ``CdcConfig`` or raises ``ConfigError`` whose message names the
offending key (as a dotted path) and the allowed keys or values. ``${NAME}`` in any string value is replaced by the
environment variable ``NAME`` (an unset variable is an error naming it). A password may only come from the
environment (``${...}``); its value never appears in ``repr``, messages or metadata.

Per kind: a ``postgres`` source has a ``PostgresConnection`` (host, port, dbname, user, password) and a ``slot`` and
``publication``; a ``mongodb`` source has a ``MongoConnection`` (``uri``: the connection string, only from the
environment, as it may hold credentials; kept as a ``Secret``) and ``mongodb`` options (``MongoOptions``:
``databases`` to list collections in, ``full_document`` mode, ``on_history_lost``: ``fail`` or ``resnapshot``), no
slot or publication (the keys are refused for it, naming the allowed ones). Both kinds share ``include``/``exclude``
(``fnmatch`` patterns over ``schema.table``, for MongoDB ``database.collection``), ``tables``, ``chunk_size``,
``read_parallelism``, ``chunks_per_run`` (chunk partitions one snapshot run reads: the planner's runs and each run
of a backfill), ``startup_mode``, ``stream`` and ``checks``.

Startup modes (Flink CDC's): ``initial`` (snapshot every chunk, stream from the start), ``latest`` (no snapshot is
requested; stream from the position when the source is first discovered), ``snapshot`` (snapshot every chunk, no
streaming beyond what the snapshot windows need), ``timestamp`` (MongoDB only: no snapshot; stream the changes after
the cluster time ``startup_timestamp``, ``SEC`` or ``SEC:ORD``; PostgreSQL refuses it: a slot cannot start in the
past). ``startup_timestamp`` is required with ``timestamp`` and refused with any other mode.

Declared fields (MongoDB only): a ``tables`` entry of a ``mongodb`` source may declare top-level fields with a type
(``fields: {price: decimal(12,2), qty: long}``, ``FieldConfig``; types ``FIELD_TYPES``), each extracted into a typed
column of the collection's lake tables (``cdc_assets/sources/mongodb/typed_fields.py``). Refused naming the key and
the collection: an unknown type, ``_id``, a name with ``.`` or starting with ``$`` or ``_cdc``, a fixed column's name,
names equal but for case; ``fields`` under a PostgreSQL source.

``lake_root`` is a local path (relative to the configuration file's folder; a ``Path``) or a URI of a scheme in
``LAKE_SCHEMES`` (kept as text: ``s3a://bucket/prefix``); another scheme is refused naming the allowed ones.

See ``cdc.yaml`` at the repository root for a documented example.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cdc_assets.engine.names import qualify, split_qualified

STARTUP_MODES = ("initial", "latest", "snapshot", "timestamp")
SOURCE_KINDS = ("postgres", "mongodb")
# change-stream fullDocument modes the MongoDB source supports: the document looked up when the event is read
# (post-images, "whenAvailable"/"required" on MongoDB 6.0+, are not supported yet)
MONGODB_FULL_DOCUMENT_MODES = ("updateLookup",)
# the change stream's ``fullDocumentBeforeChange``: pre-images as the changelog's before image (MongoDB 6.0+, on
# collections where an administrator enabled ``changeStreamPreAndPostImages``)
MONGODB_BEFORE_CHANGE_MODES = ("off", "whenAvailable", "required")
# what a MongoDB source does when the oplog no longer holds every change after its recorded position
MONGODB_ON_HISTORY_LOST = ("fail", "resnapshot")
MAX_UINT32 = (1 << 32) - 1
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the allowed values."""


@dataclass(frozen=True)
class Secret:
    """A credential: compares by value, never prints it."""

    value: str = field(repr=False)

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


# the types a MongoDB collection's declared top-level fields may have (docs/mongodb.md, "Typed fields")
FIELD_TYPES = ("string", "int", "long", "double", "decimal(p,s)", "boolean", "timestamp", "date", "binary")
FIELD_TYPES_TEXT = (
    "string, int, long, double, decimal(p,s) (1 <= p <= 38, 0 <= s <= p), boolean, timestamp, date, binary"
)
# a MongoDB collection's fixed lake columns (cdc_assets/sources/mongodb/catalog.py): no declared field may take them
MONGODB_FIXED_COLUMNS = ("_id_key", "_id", "document", "_cdc_unrepresentable")
_DECIMAL_TYPE = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


@dataclass(frozen=True)
class FieldConfig:
    """A declared top-level field of a MongoDB collection: its name and type (``FIELD_TYPES``; a decimal as
    ``decimal(p,s)`` with its precision and scale, spaces removed)."""

    name: str
    type: str


@dataclass(frozen=True)
class TableConfig:
    schema: str
    name: str
    surrogate_key: tuple[str, ...] = ()
    chunk_size: int | None = None
    fields: tuple[FieldConfig, ...] = ()  # MongoDB only: declared top-level fields extracted to typed columns

    @property
    def qualified_name(self) -> str:
        return qualify(self.schema, self.name)


@dataclass(frozen=True)
class PostgresConnection:
    host: str
    port: int
    dbname: str
    user: str
    password: Secret | None
    sslmode: str | None = None
    connect_timeout: int = 10

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the PostgreSQL driver's ``connect`` (holds the password: never log this)."""
        params: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "dbname": self.dbname,
            "user": self.user,
            "connect_timeout": self.connect_timeout,
            "application_name": "cdc-lake",
        }
        if self.password is not None:
            params["password"] = self.password.value
        if self.sslmode:
            params["sslmode"] = self.sslmode
        return params

    def describe(self) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.dbname}"


def redact_uri(uri: str) -> str:
    """A MongoDB connection string without credentials: the user information and any password-like query option
    replaced by ``***`` (for messages: hosts and options stay, secrets never)."""
    scheme, separator, rest = uri.partition("://")
    if not separator:
        return "***"
    authority, slash, tail = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    tail = re.sub(r"(?i)((?:password|secret|token|authMechanismProperties)[^=&]*=)[^&]*", r"\1***", tail)
    return f"{scheme}://{authority}{slash}{tail}"


@dataclass(frozen=True)
class MongoConnection:
    """A MongoDB connection string (a ``Secret``: it may hold a user and password) and the client's timeouts."""

    uri: Secret
    server_selection_timeout_ms: int = 10_000
    connect_timeout_ms: int = 10_000

    def describe(self) -> str:
        return redact_uri(self.uri.value)


@dataclass(frozen=True)
class MongoOptions:
    """What only a MongoDB source has: the databases whose collections ``include``/``exclude`` choose from (empty:
    every database the user may list, except ``admin``, ``local`` and ``config``), the change stream's
    ``fullDocument`` mode, its ``fullDocumentBeforeChange`` mode (``full_document_before_change``: ``off``;
    ``whenAvailable`` fills the changelog's before image where the server has the pre-image; ``required`` fails
    the stream where it has not), and what to do when the oplog lost changes the stream still needs
    (``on_history_lost``: ``fail`` stops the stream naming the oplog window; ``resnapshot`` restarts it at the
    current position and has every chunk of every captured collection read again)."""

    databases: tuple[str, ...] = ()
    full_document: str = "updateLookup"
    full_document_before_change: str = "off"
    on_history_lost: str = "fail"


@dataclass(frozen=True)
class StreamConfig:
    interval_seconds: int = 5
    # bound of one batch: each batch pays fixed Delta commits and Spark jobs, so larger batches apply a backlog faster
    # (bench.stream, 1M changes: 9.5k changes/s at 100k, 13.6k at 250k, 16.2k at 500k; same JVM and driver RSS)
    max_changes: int = 500_000
    # the same bound in bytes (the captured tables' change messages; stops at a transaction boundary too): memory is
    # bounded by bytes, not rows, so rows of big values make small batches (a larger transaction streams spilled)
    max_batch_bytes: int = 256 * 1024 * 1024
    max_lag_bytes: int = 256 * 1024 * 1024
    spill_rows: int = 50_000
    # bytes of change messages per spilled Parquet part (one row group; a larger single value is a part of its own)
    spill_bytes: int = 32 * 1024 * 1024
    # the stream asset's check ``lag_within_bound`` fails when the slot lags the server by more than these
    max_lag_alert_bytes: int = 1024 * 1024 * 1024
    max_lag_alert_seconds: int = 900
    # the streaming sensor waits this long for the source's position and lag (Dagster stops a tick after 60 s)
    sensor_timeout_seconds: int = 30
    # a stream run keeps its Spark session and runs batches for up to this many seconds (0: one batch per run)
    run_seconds: int = 0
    # how often a long-lived stream run asks the source whether a batch is due
    poll_seconds: int = 1
    # a stream run still in flight this long past ``run_seconds`` is ended by Dagster's run monitor (the run's tag
    # ``dagster/max_runtime`` = run_seconds + this; 0: no bound): a run whose code server died with it (a lost machine,
    # ``kill -9`` of ``dagster dev``) stays STARTED, and the sensor launches no other run of the source until it ends.
    # Above the longest batch the source can take (a batch that always outlasts it never completes; the run fails
    # saying "Exceeded maximum runtime")
    max_overrun_seconds: int = 1800
    # a successor stream run is requested this long before the run in flight reaches ``run_seconds`` (at most half of
    # ``run_seconds``; 0: none before the run ends): it starts its Spark driver and warms it outside the lake-write
    # pool, and the run in flight ends after its current batch as soon as the successor is warm, so the first batch
    # of the next run does not pay a driver start and a cold JVM's MERGE (7.6 s against 1.4 s warm, bench.freshness).
    # 120: the warm-up of one table took 41.6 s beside a predecessor streaming 1k changes/s on 2 cores (2026-12-05),
    # and a warm-up unfinished when the predecessor ends stops half done; waiting longer costs an idle process
    handoff_seconds: int = 120
    # lake upkeep between stream batches (cdc_assets.lake.maintenance), each step at most this often (0: never; then
    # run it yourself): staged rows of finished snapshots dropped and tables compacted; files no longer referenced
    # deleted from storage (VACUUM)
    compact_seconds: int = 3600
    vacuum_seconds: int = 86400
    # compaction packs files smaller than this into files of about this size
    compact_target_mb: int = 64

    @property
    def handoff_lead_seconds(self) -> int:
        """How long before the run in flight ends its successor is requested: ``handoff_seconds``, at most half of
        ``run_seconds`` (a successor warm sooner would end its predecessor sooner); 0 for one batch per run."""
        return min(self.handoff_seconds, self.run_seconds // 2)

    @property
    def max_runtime_seconds(self) -> int | None:
        """The bound of a stream run's time in flight (Dagster's ``dagster/max_runtime`` tag), None for no bound: a
        successor waits up to ``handoff_lead_seconds`` for its predecessor before its own ``run_seconds``."""
        if not self.max_overrun_seconds:
            return None
        return self.handoff_lead_seconds + self.run_seconds + self.max_overrun_seconds


@dataclass(frozen=True)
class ChecksConfig:
    # the consistency sweep: every chunk of every captured table checked (asset check ``chunk_matches_source`` over
    # the range of all chunks, one run per table) on this cron schedule, in UTC; None ("off"): no sweep
    cron: str | None = "0 3 * * *"
    # chunks compared in one watermark window (one source transaction, one wait for the stream) by a range run
    chunks_per_window: int = 8


CRON_FIELDS = ("minute", "hour", "day of month", "month", "day of week")


@dataclass(frozen=True)
class SourceConfig:
    name: str
    kind: str
    connection: PostgresConnection | MongoConnection
    slot: str
    publication: str
    startup_mode: str
    chunk_size: int
    read_parallelism: int
    tables: tuple[TableConfig, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    stream: StreamConfig
    checks: ChecksConfig = ChecksConfig()
    mongodb: MongoOptions | None = None  # set exactly for kind mongodb
    chunks_per_run: int = 4  # chunk partitions per snapshot run (planner runs, backfill runs)
    # how often the planner sensor looks for tables to plan and chunks to snapshot (a table added at the source is
    # planned at its first tick after "Reload definitions")
    planner_interval_seconds: int = 30
    startup_timestamp: str | None = None  # SEC or SEC:ORD, exactly with startup_mode timestamp
    # the planner's snapshot runs: how often Dagster's daemon runs one again after it failed (its process killed, its
    # machine lost, its step out of retries; Dagster's ``dagster/max_retries``, 0: never), and how long one may be in
    # flight before Dagster's run monitor fails it (``dagster/max_runtime``, 0: no bound), which ends a run orphaned
    # with its code server; it then counts as a failure and is retried
    snapshot_run_retries: int = 3
    snapshot_run_max_runtime_seconds: int = 21600


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[2]"
    remote: str | None = None
    conf: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CdcConfig:
    lake_root: Path | str  # a local folder, or an object store's URI (``LAKE_SCHEMES``)
    spark: SparkConfig
    sources: tuple[SourceConfig, ...]

    def source(self, name: str) -> SourceConfig:
        for source in self.sources:
            if source.name == name:
                return source
        raise ConfigError(f"unknown source {name!r}; configured sources: {[s.name for s in self.sources]}")


def load_config(path: str | os.PathLike[str], environ: dict[str, str] | None = None) -> CdcConfig:
    """Read and validate the configuration file at ``path`` (see module docstring)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"configuration file not found: {path}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    return parse_config(raw, base_dir=path.parent, environ=os.environ if environ is None else environ)


def parse_config(raw: Any, base_dir: Path, environ: dict[str, str] | os._Environ[str]) -> CdcConfig:
    top = _mapping(raw, "", {"lake_root", "spark", "sources"}, required={"lake_root", "sources"})
    lake_root = _lake_root(_string(_resolve(top["lake_root"], "lake_root", environ), "lake_root"), base_dir)
    spark = _spark(top.get("spark") or {}, environ)
    sources_raw = top["sources"]
    if not isinstance(sources_raw, list) or not sources_raw:
        raise ConfigError("sources: expected a non-empty list of sources")
    sources = tuple(_source(item, f"sources[{i}]", environ) for i, item in enumerate(sources_raw))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"sources: names must be unique, got {names}")
    return CdcConfig(lake_root=lake_root, spark=spark, sources=sources)


LAKE_SCHEMES = ("s3a", "file")


def _lake_root(text: str, base_dir: Path) -> Path | str:
    scheme, separator, rest = text.partition("://")
    if not separator:
        root = Path(text)
        return root if root.is_absolute() else (base_dir / root).resolve()
    if scheme == "file":
        return Path(rest)
    if scheme not in LAKE_SCHEMES:
        raise ConfigError(
            f"lake_root: scheme {scheme!r} is not supported; allowed: a local path, or a URI of "
            f"{', '.join(LAKE_SCHEMES)}"
        )
    bucket = rest.partition("/")[0]
    if not bucket:
        raise ConfigError(f"lake_root: {text!r} names no bucket; expected {scheme}://<bucket>/<prefix>")
    return text.rstrip("/")


def _spark(raw: Any, environ: Any) -> SparkConfig:
    spark = _mapping(raw, "spark", {"master", "remote", "conf"})
    conf_raw = _mapping(spark.get("conf") or {}, "spark.conf", None)
    conf = {str(k): str(_resolve(v, f"spark.conf.{k}", environ)) for k, v in conf_raw.items()}
    remote = spark.get("remote")
    return SparkConfig(
        master=_string(_resolve(spark.get("master", "local[2]"), "spark.master", environ), "spark.master"),
        remote=None if remote is None else _string(_resolve(remote, "spark.remote", environ), "spark.remote"),
        conf=conf,
    )


_SOURCE_KEYS = {
    "name", "kind", "connection", "slot", "publication", "startup_mode", "chunk_size", "read_parallelism",
    "chunks_per_run", "tables", "include", "exclude", "stream", "checks", "startup_timestamp",
    "planner_interval_seconds", "snapshot_run_retries", "snapshot_run_max_runtime_seconds",
}  # fmt: skip
_MONGODB_SOURCE_KEYS = (_SOURCE_KEYS - {"slot", "publication"}) | {"mongodb"}


def _source(raw: Any, where: str, environ: Any) -> SourceConfig:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and "kind" in raw and kind not in SOURCE_KINDS:
        raise ConfigError(f"{where}.kind: {kind!r} is not supported; allowed: {', '.join(SOURCE_KINDS)}")
    allowed = _MONGODB_SOURCE_KEYS if kind == "mongodb" else _SOURCE_KEYS
    source = _mapping(raw, where, allowed, required={"name", "kind", "connection"})
    name = _identifier(source["name"], f"{where}.name")
    mode = source.get("startup_mode", "initial")
    if mode not in STARTUP_MODES:
        raise ConfigError(f"{where}.startup_mode: {mode!r} is not allowed; allowed: {', '.join(STARTUP_MODES)}")
    if mode == "timestamp" and kind == "postgres":
        raise ConfigError(
            f"{where}.startup_mode: 'timestamp' is not possible for PostgreSQL: a replication slot cannot start "
            "in the past; use 'initial' (snapshot, then stream) or 'latest' (stream from now)"
        )
    startup_timestamp = _startup_timestamp(source.get("startup_timestamp"), mode, f"{where}.startup_timestamp")
    tables = tuple(_table(t, f"{where}.tables[{i}]", kind) for i, t in enumerate(source.get("tables") or []))
    include = tuple(_string(p, f"{where}.include") for p in source.get("include") or [])
    exclude = tuple(_string(p, f"{where}.exclude") for p in source.get("exclude") or [])
    if not tables and not include:
        raise ConfigError(f"{where}: capture nothing; name tables under 'tables' or patterns under 'include'")
    connection: PostgresConnection | MongoConnection
    mongodb = None
    if kind == "mongodb":
        connection = _mongo_connection(source["connection"], f"{where}.connection", environ)
        mongodb = _mongo_options(source.get("mongodb") or {}, f"{where}.mongodb")
        slot = publication = ""
    else:
        connection = _connection(source["connection"], f"{where}.connection", environ)
        slot = _identifier(source.get("slot", f"cdc_{name}"), f"{where}.slot")
        publication = _identifier(source.get("publication", f"cdc_{name}"), f"{where}.publication")
    return SourceConfig(
        name=name,
        kind=kind,
        connection=connection,
        slot=slot,
        publication=publication,
        startup_mode=mode,
        chunk_size=_positive_int(source.get("chunk_size", 50_000), f"{where}.chunk_size"),
        read_parallelism=_positive_int(source.get("read_parallelism", 2), f"{where}.read_parallelism"),
        chunks_per_run=_positive_int(source.get("chunks_per_run", 4), f"{where}.chunks_per_run"),
        planner_interval_seconds=_positive_int(
            source.get("planner_interval_seconds", 30), f"{where}.planner_interval_seconds"
        ),
        snapshot_run_retries=_positive_int(
            source.get("snapshot_run_retries", SourceConfig.snapshot_run_retries),
            f"{where}.snapshot_run_retries",
            zero_is_off=True,
        ),
        snapshot_run_max_runtime_seconds=_positive_int(
            source.get("snapshot_run_max_runtime_seconds", SourceConfig.snapshot_run_max_runtime_seconds),
            f"{where}.snapshot_run_max_runtime_seconds",
            zero_is_off=True,
        ),
        tables=tables,
        include=include,
        exclude=exclude,
        stream=_stream(source.get("stream") or {}, f"{where}.stream"),
        checks=_checks(source.get("checks") or {}, f"{where}.checks"),
        mongodb=mongodb,
        startup_timestamp=startup_timestamp,
    )


def _startup_timestamp(raw: Any, mode: str, where: str) -> str | None:
    """The cluster time of ``startup_mode: timestamp`` as ``SEC`` or ``SEC:ORD`` text (checked here for its form;
    whether the oplog still holds it is asked of the server when the stream start is fixed)."""
    forms = "SEC or SEC:ORD (a cluster time's seconds and increment, decimal; quote SEC:ORD in YAML)"
    if mode != "timestamp":
        if raw is not None:
            raise ConfigError(f"{where}: only read with startup_mode: timestamp (the mode is {mode!r}); remove it")
        return None
    if raw is None:
        raise ConfigError(f"{where}: required with startup_mode: timestamp; allowed: {forms}")
    if isinstance(raw, int) and not isinstance(raw, bool):
        if not 0 <= raw <= MAX_UINT32:  # YAML 1.1 reads an unquoted 1700000000:5 as a base-60 integer
            raise ConfigError(f"{where}: {raw!r} is not {forms}")
        return str(raw)
    text = str(raw).strip() if isinstance(raw, str) else ""
    parts = text.split(":")
    if not text or len(parts) > 2 or not all(p.isdigit() and int(p) <= MAX_UINT32 for p in parts):
        raise ConfigError(f"{where}: {raw!r} is not {forms}")
    return text


def _mongo_connection(raw: Any, where: str, environ: Any) -> MongoConnection:
    keys = {"uri", "server_selection_timeout_ms", "connect_timeout_ms"}
    connection = _mapping(raw, where, keys, required={"uri"})
    uri = connection["uri"]
    if not isinstance(uri, str) or not _ENV_REFERENCE.fullmatch(uri.strip()):
        raise ConfigError(
            f"{where}.uri: must come from the environment, written as ${{VARIABLE_NAME}} (a connection string may "
            "hold credentials); a literal connection string is not accepted"
        )
    value = str(_resolve(uri.strip(), f"{where}.uri", environ))
    if not value.startswith(("mongodb://", "mongodb+srv://")):
        raise ConfigError(
            f"{where}.uri: the environment variable {uri.strip()} does not hold a MongoDB connection string; "
            "allowed: mongodb://... or mongodb+srv://..."
        )
    defaults = MongoConnection(Secret(""))
    return MongoConnection(
        uri=Secret(value),
        server_selection_timeout_ms=_positive_int(
            connection.get("server_selection_timeout_ms", defaults.server_selection_timeout_ms),
            f"{where}.server_selection_timeout_ms",
        ),
        connect_timeout_ms=_positive_int(
            connection.get("connect_timeout_ms", defaults.connect_timeout_ms), f"{where}.connect_timeout_ms"
        ),
    )


def _mongo_options(raw: Any, where: str) -> MongoOptions:
    options = _mapping(raw, where, {"databases", "full_document", "full_document_before_change", "on_history_lost"})
    databases = options.get("databases") or []
    if isinstance(databases, str):
        databases = [databases]
    if not isinstance(databases, list):
        raise ConfigError(f"{where}.databases: expected a list of database names, got {databases!r}")
    mode = options.get("full_document", "updateLookup")
    if mode not in MONGODB_FULL_DOCUMENT_MODES:
        raise ConfigError(
            f"{where}.full_document: {mode!r} is not supported; allowed: {', '.join(MONGODB_FULL_DOCUMENT_MODES)}"
        )
    before_change = options.get("full_document_before_change", "off")
    if before_change is False:  # YAML reads a bare off as false
        before_change = "off"
    if before_change not in MONGODB_BEFORE_CHANGE_MODES:
        raise ConfigError(
            f"{where}.full_document_before_change: {before_change!r} is not allowed; allowed: "
            f"{', '.join(MONGODB_BEFORE_CHANGE_MODES)}"
        )
    on_history_lost = options.get("on_history_lost", "fail")
    if on_history_lost not in MONGODB_ON_HISTORY_LOST:
        raise ConfigError(
            f"{where}.on_history_lost: {on_history_lost!r} is not allowed; allowed: "
            f"{', '.join(MONGODB_ON_HISTORY_LOST)}"
        )
    return MongoOptions(
        databases=tuple(_string(d, f"{where}.databases") for d in databases), full_document=str(mode),
        full_document_before_change=str(before_change), on_history_lost=str(on_history_lost),
    )  # fmt: skip


def _connection(raw: Any, where: str, environ: Any) -> PostgresConnection:
    keys = {"host", "port", "dbname", "user", "password", "sslmode", "connect_timeout"}
    connection = _mapping(raw, where, keys, required={"host", "dbname", "user"})
    password = connection.get("password")
    secret = None
    if password is not None:
        if not isinstance(password, str) or not _ENV_REFERENCE.fullmatch(password.strip()):
            raise ConfigError(
                f"{where}.password: must come from the environment, written as ${{VARIABLE_NAME}}; "
                "a literal password is not accepted"
            )
        secret = Secret(str(_resolve(password.strip(), f"{where}.password", environ)))
    return PostgresConnection(
        host=_string(_resolve(connection["host"], f"{where}.host", environ), f"{where}.host"),
        port=_positive_int(_resolve(connection.get("port", 5432), f"{where}.port", environ), f"{where}.port"),
        dbname=_string(_resolve(connection["dbname"], f"{where}.dbname", environ), f"{where}.dbname"),
        user=_string(_resolve(connection["user"], f"{where}.user", environ), f"{where}.user"),
        password=secret,
        sslmode=connection.get("sslmode"),
        connect_timeout=_positive_int(connection.get("connect_timeout", 10), f"{where}.connect_timeout"),
    )


MAX_SENSOR_TIMEOUT_SECONDS = 50


def _stream(raw: Any, where: str) -> StreamConfig:
    positive = {
        "interval_seconds", "max_changes", "max_lag_bytes", "spill_rows", "poll_seconds", "compact_target_mb",
        "max_batch_bytes", "spill_bytes", "max_lag_alert_bytes", "max_lag_alert_seconds", "sensor_timeout_seconds",
    }  # fmt: skip
    zero_or_positive = {"run_seconds", "compact_seconds", "vacuum_seconds", "max_overrun_seconds", "handoff_seconds"}
    stream = _mapping(raw, where, positive | zero_or_positive)
    defaults = StreamConfig()
    values = {k: _positive_int(stream.get(k, getattr(defaults, k)), f"{where}.{k}") for k in positive}
    for key in zero_or_positive:
        values[key] = _positive_int(stream.get(key, getattr(defaults, key)), f"{where}.{key}", zero_is_off=True)
    if values["sensor_timeout_seconds"] > MAX_SENSOR_TIMEOUT_SECONDS:
        raise ConfigError(
            f"{where}.sensor_timeout_seconds: {values['sensor_timeout_seconds']} is too long; allowed: 1 to "
            f"{MAX_SENSOR_TIMEOUT_SECONDS} seconds (Dagster stops a sensor tick after 60 s)"
        )
    return StreamConfig(**values)


def _checks(raw: Any, where: str) -> ChecksConfig:
    checks = _mapping(raw, where, {"cron", "chunks_per_window"})
    defaults = ChecksConfig()
    per_window = _positive_int(
        checks.get("chunks_per_window", defaults.chunks_per_window), f"{where}.chunks_per_window"
    )
    cron = checks.get("cron", defaults.cron)
    if cron is None or cron is False or cron == "off":  # YAML reads a bare off as false
        return ChecksConfig(cron=None, chunks_per_window=per_window)
    if not isinstance(cron, str) or len(cron.split()) != len(CRON_FIELDS):
        raise ConfigError(
            f"{where}.cron: {cron!r} is not a cron expression; allowed: five fields ({', '.join(CRON_FIELDS)}), "
            "e.g. '0 3 * * *' (daily at 03:00 UTC), or 'off'"
        )
    return ChecksConfig(cron=" ".join(cron.split()), chunks_per_window=per_window)


def _table(raw: Any, where: str, kind: str | None = None) -> TableConfig:
    if isinstance(raw, str):
        raw = {"name": raw}
    keys = {"name", "surrogate_key", "chunk_size"}
    if isinstance(raw, dict) and "fields" in raw and kind != "mongodb":
        raise ConfigError(
            f"{where}.fields: declared typed fields are for MongoDB sources only (a PostgreSQL table's columns are "
            f"typed by its catalog); remove it. Allowed keys here: {', '.join(sorted(keys))}"
        )
    table = _mapping(raw, where, keys | {"fields"} if kind == "mongodb" else keys, required={"name"})
    schema, name = split_table_name(_string(table["name"], f"{where}.name"), f"{where}.name")
    surrogate = table.get("surrogate_key") or []
    if isinstance(surrogate, str):
        surrogate = [surrogate]
    chunk_size = table.get("chunk_size")
    return TableConfig(
        schema=schema,
        name=name,
        surrogate_key=tuple(_string(c, f"{where}.surrogate_key") for c in surrogate),
        chunk_size=None if chunk_size is None else _positive_int(chunk_size, f"{where}.chunk_size"),
        fields=_fields(table.get("fields"), f"{where}.fields", qualify(schema, name)),
    )


def _fields(raw: Any, where: str, collection: str) -> tuple[FieldConfig, ...]:
    """A collection's declared top-level fields (``{name: type}``), in the order given. Refused, naming the key, the
    collection and what is allowed: a type outside ``FIELD_TYPES``; the name ``_id`` (the key has its columns), a
    name holding ``.`` or a NUL or starting with ``$`` (not a top-level field), starting with ``_cdc`` (the lake's
    columns) or equal to a fixed column; two names equal but for case (Spark's column names ignore case)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: expected a mapping of top-level field name to type for collection {collection}, got "
            f"{type(raw).__name__}; allowed types: {FIELD_TYPES_TEXT}"
        )
    fields: list[FieldConfig] = []
    seen: dict[str, str] = {}
    for name, type_text in raw.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: {name!r} is not a field name (collection {collection}); expected a string")
        at = f"{where}.{name}"
        if name == "_id":
            reason = "the _id is the key (columns _id_key and _id) and stays in document"
        elif "." in name or "\0" in name:
            reason = "only top-level fields are extracted: no '.' (a path into a subdocument) or NUL in the name"
        elif name.startswith("$"):
            reason = "a field name starting with '$' is an operator, not a field"
        elif name.lower().startswith("_cdc") or name.lower() in MONGODB_FIXED_COLUMNS:
            reason = f"the name is taken by the lake's columns ({', '.join(MONGODB_FIXED_COLUMNS)}, _cdc_*)"
        elif name.lower() in seen:
            reason = f"it equals {seen[name.lower()]!r} but for case, and Spark's column names ignore case"
        else:
            reason = None
        if reason is not None:
            raise ConfigError(f"{at}: field {name!r} of collection {collection} cannot be declared: {reason}")
        seen[name.lower()] = name
        fields.append(FieldConfig(name, _field_type(type_text, at, collection)))
    return tuple(fields)


def _field_type(raw: Any, where: str, collection: str) -> str:
    text = raw.strip().lower() if isinstance(raw, str) else ""
    decimal = _DECIMAL_TYPE.fullmatch(text)
    if decimal is not None:
        precision, scale = int(decimal.group(1)), int(decimal.group(2))
        if 1 <= precision <= 38 and scale <= precision:
            return f"decimal({precision},{scale})"
    elif text in FIELD_TYPES and text != "decimal(p,s)":
        return text
    raise ConfigError(f"{where}: type {raw!r} is not allowed (collection {collection}); allowed: {FIELD_TYPES_TEXT}")


def split_table_name(text: str, where: str) -> tuple[str, str]:
    """``schema.table`` or ``table`` (schema ``public``); a part holding ``.`` or ``"`` is double-quoted with ``"``
    doubled, as PostgreSQL writes it (``'"my.schema"."Order Items"'``); other parts are taken as they are (case
    and spaces kept: ``public.Order Items``)."""
    if '"' not in text and "." not in text and text:
        return "public", text
    try:
        return split_qualified(text)
    except ValueError:
        pass
    if text.startswith('"'):  # a quoted table name alone
        try:
            return split_qualified(f"public.{text}")
        except ValueError:
            pass
    raise ConfigError(
        f"{where}: {text!r} is not a table name; expected 'schema.table' or 'table' (double-quote a part holding "
        "'.' or '\"', doubling its '\"')"
    )


def _mapping(raw: Any, where: str, allowed: set[str] | None, required: set[str] = frozenset()) -> dict:
    label = where or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{label}: expected a mapping, got {type(raw).__name__}")
    if allowed is not None:
        unknown = sorted(set(map(str, raw)) - allowed)
        if unknown:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"unknown key {prefix}{unknown[0]}; allowed keys here: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(raw))
    if missing:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"missing required key {prefix}{missing[0]}")
    return raw


def _resolve(value: Any, where: str, environ: Any) -> Any:
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return environ[name]

    return _ENV_REFERENCE.sub(substitute, value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _identifier(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ConfigError(f"{where}: {value!r} is not allowed; use lower-case letters, digits and '_' (max 63)")
    return value


def _positive_int(value: Any, where: str, zero_is_off: bool = False) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not zero_is_off):
        expected = "0 (off) or a positive integer" if zero_is_off else "a positive integer"
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    return value
