"""Build the Spark driver's class archive (``cdc_assets.lake.class_archive``): ``python -m
cdc_assets.lake.build_class_archive [--if-stale]``, run by ``scripts/setup.sh`` after the jars.

Contract: ``build_archive(archive)`` starts a driver as ``spark_session`` does, with ``-XX:ArchiveClassesAtExit``,
runs ``exercise``: Delta's create, append, MERGE (with deletion vectors and Change Data Feed), delete, Change Data
Feed and Parquet reads, a shuffle, a window and Arrow transfers in both directions, in a temporary folder, then ends
the JVM (it writes the archive as it exits) and moves the archive into place in one rename, so a driver starting
meanwhile maps either the old archive or the new one; a ``RuntimeError`` when the JVM wrote none, or when this
process already runs a Spark session. ``--if-stale`` builds only when ``archive_is_stale`` for
``classpath_files()``: the jars on a local driver's classpath (PySpark's, ``jars_folder()``'s) and ``java``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_assets.config import SparkConfig
from cdc_assets.lake.class_archive import ARCHIVE_AT_EXIT_OPTION, archive_is_stale
from cdc_assets.lake.spark import (
    BASE_CONF,
    DRIVER_JAVA_OPTIONS,
    class_archive_path,
    driver_process,
    jars_folder,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# the dump's own warnings (classes CDS cannot hold: old class-file versions, generated accessors) are expected
QUIET_DUMP_OPTION = "-Xlog:cds=error,cds+dynamic=error"
JVM_EXIT_SECONDS = 300


def classpath_files() -> list[Path]:
    """The files whose change makes an archive unusable: the jars on a local driver's classpath (PySpark's own,
    those of ``jars_folder()`` directly in it) and the ``java`` binary."""
    import pyspark

    files = sorted((Path(pyspark.__file__).parent / "jars").glob("*.jar")) + sorted(jars_folder().glob("*.jar"))
    java_home = os.environ.get("JAVA_HOME")  # the java Spark's launcher runs: $JAVA_HOME/bin/java, else PATH's
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if java:
        files.append(Path(java).resolve())
    return files


def exercise(spark: SparkSession, folder: Path) -> None:
    """The operations whose classes the archive should hold: what snapshot and stream runs do to a mirror."""
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    path = str(folder / "mirror")
    (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumn("id", "bigint")
        .addColumn("amount", "decimal(12,2)")
        .addColumn("note", "string")
        .addColumn("at", "timestamp")
        .property("delta.enableChangeDataFeed", "true")
        .property("delta.enableDeletionVectors", "true")
        .execute()
    )
    rows = spark.range(0, 20_000).select(
        "id", (F.col("id") / 100).cast("decimal(12,2)").alias("amount"), F.col("id").cast("string").alias("note"),
        F.current_timestamp().alias("at"),
    )  # fmt: skip
    rows.write.format("delta").mode("append").save(path)
    staged = str(folder / "staged")
    rows.where(F.col("id") % 3 == 0).withColumn("note", F.lit("changed")).write.parquet(staged)
    latest = Window.partitionBy("id").orderBy(F.col("amount").desc())
    changes = spark.read.parquet(staged).withColumn("_rank", F.row_number().over(latest)).where("_rank = 1")
    table = DeltaTable.forPath(spark, path)
    (
        table.alias("t")
        .merge(changes.alias("s"), "t.id = s.id")
        .whenMatchedUpdate(set={"note": "s.note"})
        .whenNotMatchedInsert(values={"id": "s.id", "amount": "s.amount", "note": "s.note", "at": "s.at"})
        .execute()
    )
    table.delete(F.col("id") % 7 == 0)
    spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(path).count()
    joined = spark.read.format("delta").load(path).join(spark.read.parquet(staged), "id", "left_semi")
    joined.groupBy((F.col("id") % 10).alias("k")).count().toPandas()
    spark.createDataFrame(joined.limit(100).toPandas()).mapInArrow(lambda batches: batches, joined.schema).count()


def build_archive(archive: Path) -> None:
    """Build the archive at ``archive`` (module Contract); a ``RuntimeError`` when the JVM wrote none."""
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is not None:
        raise RuntimeError("the class archive is built in a process of its own: a Spark session is running here")
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    options = f"{BASE_CONF[DRIVER_JAVA_OPTIONS]} {QUIET_DUMP_OPTION} {ARCHIVE_AT_EXIT_OPTION}{partial}"
    spark = spark_session(SparkConfig(conf={DRIVER_JAVA_OPTIONS: options}), use_class_archive=False)
    jvm = driver_process()
    assert jvm is not None  # a local driver, started just above
    try:
        with tempfile.TemporaryDirectory(prefix="cdc-class-archive-") as folder:
            exercise(spark, Path(folder))
    finally:
        spark.stop()
        jvm.stdin.close()  # the JVM exits when its standard input ends, and writes the archive as it does
        jvm.wait(timeout=JVM_EXIT_SECONDS)
    if not partial.is_file():
        raise RuntimeError(f"the driver JVM exited ({jvm.returncode}) without writing the class archive {partial}")
    partial.replace(archive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the Spark driver's class archive (module docstring).")
    parser.add_argument("--if-stale", action="store_true", help="only when missing or older than the classpath")
    args = parser.parse_args(argv)
    archive = class_archive_path()
    if args.if_stale and not archive_is_stale(archive, classpath_files()):
        print(f"class archive up to date: {archive}")
        return 0
    started = time.monotonic()
    build_archive(archive)
    size = archive.stat().st_size / 2**20
    print(f"class archive built in {time.monotonic() - started:.0f} s: {archive} ({size:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
