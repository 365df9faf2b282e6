"""The Spark session with Delta Lake.

Contract: ``spark_session(config)`` returns the process's Spark session (created
once, then reused), configured for Delta (SQL extension, catalog), the UTC session time zone (the codec's timestamps
are UTC instants), Arrow transfers, and the user's ``spark.conf``. A local driver's heap (``spark.driver.memory``;
local mode: the driver is the executor, so this heap bounds every task) defaults to ``default_driver_memory()``: a
quarter of the machine's memory (or of the container's limit, cgroup v1 or v2), at least 1g, at most 16g;
``spark.conf`` in ``cdc.yaml`` overrides it. Beside the heap the JVM holds direct buffers (its default cap: the
heap size again): parquet-mr's Snappy codecs grow them to each page they compress (a page of one 100 MB value: ~220
MB) and free them only when a full collection finds them. Parquet writers check their buffered size after every
row (``parquet.page.size.row.check.min`` = 1, no estimate of the next check; parquet-mr's defaults buffer 100 values
before they look, 1 GB of 10 MB values, and after small rows up to 10000), so a page of big values is cut by bytes
(a row group is cut by its compressed size: ``big_batch_conf`` makes those small for rows of big values).
``remote`` connects to a Spark Connect server instead of starting a driver. A local driver loads the Delta jars that
``scripts/setup.sh`` fetched with Maven into ``.jars/`` (or the folder named by ``CDC_JARS_DIR``);
Python workers run the driver's interpreter unless ``PYSPARK_PYTHON`` says otherwise. A local driver maps the class
archive ``scripts/setup.sh`` built beside those jars (``cdc_assets.lake.class_archive``: its JVM options get
``-XX:SharedArchiveFile`` unless they name their own archive or ``-Xshare:off``). ``session_conf(spark,
settings)`` sets ``settings`` in the session's conf for the duration of a block, then restores the previous values.

An object store lake: ``spark_session(config, lake_root)`` with an ``s3a://bucket/prefix`` lake root (a ``str``:
``pathlib.Path`` collapses ``//``) also loads the s3a jars (hadoop-aws and the AWS SDK bundle, ``object_store_jars``:
``EXTRAS=s3 scripts/setup.sh`` fetches them into ``.jars/s3/``, or the folder named by ``CDC_S3_JARS_DIR``; a
``RuntimeError`` naming that command when they are missing) and sets the s3a settings that are not secrets
(``object_store_conf``: endpoint and region from the environment); ``spark.conf`` in ``cdc.yaml`` overrides them.
Credentials never enter the Spark conf: s3a's default provider chain reads them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` in the driver JVM's environment, which it inherits from this
process when it starts: set them before the process's first session; then instance metadata). Any other lake root
(a local path, ``None``) adds nothing. Delta's log store for s3a (``S3SingleDriverLogStore``) makes one driver's
commits safe, not those of several drivers writing the same table at once. Only one Spark session per process: a
later call returns the running one, and an s3a lake root then needs it to have been started with the s3a jars (a
``RuntimeError`` otherwise); its ``spark.hadoop.*`` settings are applied to the running session's Hadoop
configuration (they reach file systems created after, not the ones already cached). A local driver whose JVM has
exited (killed by the kernel's OOM killer, or by an operator) is forgotten by the next call, which starts a new one
(``forget_exited_driver``): PySpark keeps the dead gateway, and every later call, a retried step's too, would fail
with py4j's "Connection refused". ``remote`` (Spark Connect) adds nothing: the server carries its own jars and
settings. ``driver_conf(config, lake_root)`` is a local driver's conf. The s3a jars go in ``spark.jars`` (a child class
loader: Spark's own classes win), which a local driver copies into its temporary folder at start (558 MB, 2-3 s for the
bundle); ``spark.driver.extraClassPath`` would not copy but would put the bundle's unshaded netty 4.1.100 and httpclient
ahead of Spark's newer ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import SparkSession

from cdc_assets.config import SparkConfig
from cdc_assets.lake.class_archive import ARCHIVE_NAME, with_class_archive
from cdc_assets.lake.object_store import endpoint_from_env, location_scheme, region_from_env

ROOT = Path(__file__).resolve().parents[2]

DERBY_OPTION = "-Dderby.system.home=/tmp/cdc-derby"
CHECKPOINT_INTERVAL_DEFAULT = "spark.databricks.delta.properties.defaults.checkpointInterval"
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
# for a driver that lives seconds to minutes (a test's runs, the torture harness's workers): C1-only JIT and the
# serial collector start and warm up about twice as fast on a small machine (a torture run's workers: 235 CPU-s
# against 300 with the tiered JIT); ``spark.driver.extraJavaOptions`` in ``cdc.yaml`` takes it
SHORT_LIVED_DRIVER_OPTIONS = f"{DERBY_OPTION} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# The throughput collector rather than G1 (Java 17's default): Spark's row work is batch work, and on 2 cores G1's
# concurrent threads compete with it. bench.stream's Spark side measured about 10% faster with it, cold and warm.
BASE_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.shuffle.partitions": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.databricks.delta.retentionDurationCheck.enabled": "false",
    "spark.databricks.delta.snapshotPartitions": "2",  # default 50: slow state reconstruction of small logs
    # every Delta table this session creates (mirrors, changelogs) writes a checkpoint of its log every 100 commits,
    # not Delta's 10: the checkpoint is written inside the commit's call, so with two tables a stream batch every
    # 10th commit paid one (0.5-1.4 s on a 50k-row mirror) and a fifth of the batches carried one, which is the
    # p95 of the commit-to-mirror latency (bench.freshness, 2026-12-03: p95 4.39 s against 4.91 and 5.01 s, the
    # changelog phase's p95 0.38 against 0.77 s); a snapshot read 99 commit files after the checkpoint no slower
    # than 9 (50k-row mirror, 100 batches). On an object store each of those files is a request: a lake there may
    # lower it in cdc.yaml's spark.conf. Tables made before keep theirs (ALTER TABLE ... SET TBLPROPERTIES
    # (delta.checkpointInterval = 100) brings one to it).
    CHECKPOINT_INTERVAL_DEFAULT: "100",
    # compiled (codegen) classes kept across batches: one stream batch's MERGE, changelog append and reconciliation
    # generate more classes than the default cache of 100 holds, so every batch compiled them all again
    # (bench.stream, 50k-row mirror, 10 batches of 8k changes: 71.3 s with 100 entries, 54-58 s with 2000)
    "spark.sql.codegen.cache.maxEntries": "2000",
    DRIVER_JAVA_OPTIONS: f"{DERBY_OPTION} -XX:+UseParallelGC",
    # Parquet writers (the changelog, the mirror) cut pages and row groups by bytes from the first row on, and look
    # after every row: parquet-mr's default estimate puts the next page check where the rows so far, at their average
    # size, would fill a page (halved, up to 10000 rows on), so big values after small rows (a changelog's or a
    # MERGE's file) could make pages of many big values (a direct-memory cap once failed on a 698 MB page), which its
    # Snappy codec copies into direct buffers of the page's size that only a full collection frees (two single
    # 2.1-2.2 GB allocations seen). The row-group check always estimates: at most 10 rows on.
    # The big-value stream test's JVM peaked at 10.8 GB without these two, 7.2-7.3 GB with them (6 GB heap).
    "spark.hadoop.parquet.page.size.row.check.min": "1",
    "spark.hadoop.parquet.page.size.check.estimate": "false",
    "spark.hadoop.parquet.page.size.row.check.max": "10",
}
DRIVER_MEMORY = "spark.driver.memory"
S3_JARS_ENV = "CDC_S3_JARS_DIR"
S3_JAR_PREFIXES = ("hadoop-aws-", "bundle-")  # jvm/s3/pom.xml: the s3a file system, the AWS SDK v2 it calls
S3A_FILE_SYSTEM = "org.apache.hadoop.fs.s3a.S3AFileSystem"
HADOOP_PREFIX = "spark.hadoop."
S3A = f"{HADOOP_PREFIX}fs.s3a"
DRIVER_MEMORY_FLOOR_MB = 1024
DRIVER_MEMORY_CAP_MB = 16 * 1024


def machine_memory_bytes() -> int:
    """Physical memory, or the container's memory limit when it is lower (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_driver_memory(total_bytes: int | None = None) -> str:
    """A quarter of ``total_bytes`` (default: ``machine_memory_bytes()``), at least 1g, at most 16g, in megabytes."""
    total = machine_memory_bytes() if total_bytes is None else total_bytes
    megabytes = min(max(total // 4 // 2**20, DRIVER_MEMORY_FLOOR_MB), DRIVER_MEMORY_CAP_MB)
    return f"{megabytes}m"


def jars_folder() -> Path:
    """The folder of the JVM jars ``scripts/setup.sh`` fetched: ``$CDC_JARS_DIR``, else ``.jars/``."""
    return Path(os.environ.get("CDC_JARS_DIR", ROOT / ".jars"))


def class_archive_path() -> Path:
    """Where ``scripts/setup.sh`` keeps the driver's class archive (``cdc_assets.lake.class_archive``): beside the
    jars it holds classes of."""
    return jars_folder() / ARCHIVE_NAME


def delta_jars() -> list[str]:
    folder = jars_folder()
    jars = sorted(str(p) for p in folder.glob("*.jar"))
    if not any("delta-spark" in Path(j).name for j in jars):
        raise RuntimeError(f"no Delta jars in {folder}: run scripts/setup.sh (Maven fetches them from jvm/pom.xml)")
    return jars


def is_s3a(lake_root: str | os.PathLike[str] | None) -> bool:
    """Whether ``lake_root`` is an ``s3a://`` URI (scheme in any case); a ``ValueError`` for one that
    ``pathlib.Path`` collapsed (``s3a:/bucket``: ``cdc_assets.lake.object_store.location_scheme``)."""
    return lake_root is not None and location_scheme(os.fspath(lake_root)) == "s3a"


def object_store_jars(lake_root: str | os.PathLike[str] | None) -> list[str]:
    """The jars an ``s3a://`` lake root needs on Spark's classpath (``.jars/s3/*.jar``, or ``$CDC_S3_JARS_DIR``'s, as
    ``local:`` URIs), none for any other root; a ``RuntimeError`` naming ``EXTRAS=s3 scripts/setup.sh`` when
    hadoop-aws or the AWS SDK bundle is missing."""
    if not is_s3a(lake_root):
        return []
    folder = Path(os.environ.get(S3_JARS_ENV, jars_folder() / "s3"))
    jars = sorted(str(p) for p in folder.glob("*.jar"))
    names = [Path(jar).name for jar in jars]
    missing = [prefix for prefix in S3_JAR_PREFIXES if not any(name.startswith(prefix) for name in names)]
    if missing:
        raise RuntimeError(
            f"no s3a jars ({', '.join(f'{m}*.jar' for m in missing)}) in {folder}: an s3a:// lake root needs them; run "
            f"EXTRAS=s3 scripts/setup.sh (Maven fetches them from jvm/s3/pom.xml), or set {S3_JARS_ENV}"
        )
    # ``local:``: used where they lie, on the driver and on every worker (a cluster's nodes need them at the same
    # path); a plain path is copied into each application's temporary folder, 541 MB with the AWS SDK bundle, which
    # a killed driver leaves behind in /tmp
    return [f"local:{jar}" for jar in jars]


def object_store_conf(
    lake_root: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The Spark settings an ``s3a://`` lake root needs that are not secrets, from ``environ`` (default
    ``os.environ``): ``fs.s3a.endpoint`` from ``AWS_ENDPOINT_URL`` when set (an ``http://`` endpoint, a local
    S3-compatible server: also path-style requests and no TLS), ``fs.s3a.endpoint.region`` from ``AWS_REGION``, else
    ``AWS_DEFAULT_REGION``, when set. Never credentials: s3a's default provider chain reads those from the driver's
    environment. Empty for any other lake root."""
    if not is_s3a(lake_root):
        return {}
    conf: dict[str, str] = {}
    endpoint = endpoint_from_env(environ)
    if endpoint is not None:
        conf[f"{S3A}.endpoint"] = endpoint
        if endpoint.lower().startswith("http://"):
            conf[f"{S3A}.path.style.access"] = "true"
            conf[f"{S3A}.connection.ssl.enabled"] = "false"
    region = region_from_env(environ)
    if region is not None:
        conf[f"{S3A}.endpoint.region"] = region
    return conf


def memory_megabytes(text: str) -> int:
    """A JVM memory size (``6144m``, ``8g``, ``512k``, bytes) in megabytes."""
    units = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}
    value = text.strip().lower().removesuffix("b")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value) // 2**20


def driver_conf(
    config: SparkConfig, lake_root: str | os.PathLike[str] | None = None, use_class_archive: bool = True
) -> dict[str, str]:
    """A local driver's Spark conf: ``BASE_CONF``, the default heap, the Delta jars (and the s3a jars for an
    ``s3a://`` lake root) in ``spark.jars``, ``object_store_conf(lake_root)``, then ``config.conf``, which overrides
    any of them; then, with ``use_class_archive``, the class archive ``scripts/setup.sh`` built added to the JVM
    options (``cdc_assets.lake.class_archive``; none when it is missing or the options name their own)."""
    jars = [*delta_jars(), *object_store_jars(lake_root)]
    conf = {
        **BASE_CONF,
        DRIVER_MEMORY: default_driver_memory(),
        "spark.jars": ",".join(jars),
        **object_store_conf(lake_root),
        **config.conf,
    }
    if use_class_archive:
        conf[DRIVER_JAVA_OPTIONS] = with_class_archive(conf.get(DRIVER_JAVA_OPTIONS, ""), class_archive_path())
    return conf


def spark_session(
    config: SparkConfig, lake_root: str | os.PathLike[str] | None = None, use_class_archive: bool = True
) -> SparkSession:
    """The process's Spark session for ``config`` and a lake at ``lake_root`` (see the module's contract);
    ``use_class_archive``: ``driver_conf``'s."""
    if config.remote:
        builder = SparkSession.builder.remote(config.remote)
        for key, value in config.conf.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # the driver's JVM (spark-submit, started from here) with two glibc malloc arenas instead of 8 per core, as Hadoop
    # and YARN set it: the big-value stream test's JVM peaked at 6.9 GB with it, 7.2-7.3 GB without (two runs each)
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    forget_exited_driver()
    builder = SparkSession.builder.master(config.master).appName("cdc-lake")
    conf = driver_conf(config, lake_root, use_class_archive)
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    if is_s3a(lake_root):
        use_running_session_for_s3a(session, conf)
    return session


def driver_process() -> subprocess.Popen | None:
    """This process's local driver JVM (PySpark's ``Popen`` of it; no public accessor), None when no local driver was
    started here (or it was forgotten)."""
    from pyspark import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def driver_exit_code() -> int | None:
    """The exit code of this process's local driver JVM, None while it runs or when no local driver was started
    here."""
    process = driver_process()
    return None if process is None else process.poll()


def forget_exited_driver() -> int | None:
    """Contract: when this process's local driver JVM has exited, drop PySpark's references to it (its gateway, its
    context, the session) so that the next ``getOrCreate`` starts a new JVM, and return the old one's exit code (-9:
    SIGKILL, the OOM killer's signal); None, changing nothing, while it runs. Why: PySpark keeps a dead gateway, and
    a step retried in the same process (Dagster's ``RetryPolicy``) failed at once with "Connection refused" on each
    attempt, its run's failure then naming only that. Uses PySpark's private class attributes (no public API
    restarts a driver); ``tests/lake/test_spark.py`` kills a driver and asks for a session again."""
    from pyspark import SparkContext

    code = driver_exit_code()
    if code is None:
        return None
    gateway = SparkContext._gateway
    with SparkContext._lock:
        SparkContext._active_spark_context = None
        SparkContext._gateway = None
        SparkContext._jvm = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    try:
        gateway.shutdown()  # its sockets and callback server; the JVM is gone already
    except Exception:  # a dead gateway may fail to close: nothing left to free then
        pass
    return code


def use_running_session_for_s3a(session: SparkSession, conf: dict[str, str]) -> None:
    """Make the process's session (maybe started earlier, for another lake root) fit an ``s3a://`` lake: a
    ``RuntimeError`` when it cannot load the s3a file system (started without hadoop-aws: jars cannot be added to a
    running JVM); ``conf``'s ``spark.hadoop.*`` entries set in its Hadoop configuration (a session started here has
    them already; a running one gets the endpoint and region, but never credentials from an environment changed since
    its JVM started)."""
    if not session._jvm.org.apache.spark.util.Utils.classIsLoadable(S3A_FILE_SYSTEM):
        raise RuntimeError(
            "the process's Spark session was started without the s3a jars and cannot load them now: the first "
            "spark_session call of a process must name the s3a:// lake root"
        )
    hadoop_conf = session.sparkContext._jsc.hadoopConfiguration()  # PySpark has no public accessor
    for key, value in conf.items():
        if key.startswith(HADOOP_PREFIX):
            hadoop_conf.set(key.removeprefix(HADOOP_PREFIX), value)


@contextmanager
def session_conf(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in the session's conf for the duration of the block, then the previous values."""
    saved = {key: spark.conf.get(key, None) for key in settings}
    try:
        for key, value in settings.items():
            spark.conf.set(key, value)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


# Spark's join planner estimates a frame's size from its Parquet files, compressed: a batch of big, compressible
# values looks small and is broadcast (built whole in the driver's heap: "Not enough memory to build and broadcast
# the table"), and so is a small-looking mirror of big values that unchanged TOAST values are looked up in
AUTO_BROADCAST = "spark.sql.autoBroadcastJoinThreshold"
MAX_PARTITION_BYTES = "spark.sql.files.maxPartitionBytes"
MERGE_SOURCE_LEVEL = "spark.databricks.delta.merge.materializeSource.rddStorageLevel"


PARQUET_BLOCK_SIZE = "parquet.block.size"  # Hadoop conf: the session's SQL conf is copied into each write's
# parquet-mr measures a row group's buffered size compressed: a row group of big, compressible values is many times
# that size when read (Spark's vectorized reader decodes a batch of a row group's rows whole: 60 values of 10 MB in
# one 128 MB row group needed 630 MB at once). Rows of big values are written in row groups of this many compressed
# bytes per spill_bytes (2 MB at 32 MB: 3 rows of 10 MB values that compress 20 times)
BIG_ROW_GROUP_SHARE = 16


def big_batch_conf(bytes_: int, rows: int, looks_up_mirror: bool, spill_bytes: int) -> dict[str, str]:
    """Session settings for one table's part of a batch (or its staged rows being reconciled), ``bytes_`` of
    changes (or staged rows) in ``rows`` rows:
    - more bytes than one spill part: no automatic broadcast joins, input partitions of at most ``spill_bytes``,
      the MERGE's materialized source on disk;
    - rows of big values (on average at least ``spill_bytes / 1024`` bytes): Parquet row groups of
      ``spill_bytes / BIG_ROW_GROUP_SHARE`` compressed bytes in the files written (mirror, changelog), so whoever
      reads them later holds one small row group at a time;
    - ``looks_up_mirror`` (unchanged TOAST values, which only big values have, are looked up in the mirror): no
      automatic broadcast joins, the mirror side may hold big values.
    A small batch of small rows keeps Spark's defaults (broadcasting a small batch spares a big mirror's shuffle)."""
    conf: dict[str, str] = {}
    if bytes_ > spill_bytes or looks_up_mirror:
        conf[AUTO_BROADCAST] = "-1"
    if bytes_ > spill_bytes:
        conf[MAX_PARTITION_BYTES] = str(spill_bytes)
        conf[MERGE_SOURCE_LEVEL] = "DISK_ONLY"
    if rows and bytes_ / rows >= spill_bytes / 1024:
        conf[PARQUET_BLOCK_SIZE] = str(max(spill_bytes // BIG_ROW_GROUP_SHARE, 64 * 1024))
    return conf
