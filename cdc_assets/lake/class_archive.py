"""The Spark driver's class archive: Java's class data sharing (CDS) for the classes Spark and Delta load.

Every Dagster run, test and benchmark process starts a Spark driver JVM, and its first seconds go to loading and
verifying the same few thousand classes of Spark, Delta and Hadoop. A dynamic CDS archive (``-XX:ArchiveClasses
AtExit``, Java 13+) holds them already parsed and verified; a JVM started with ``-XX:SharedArchiveFile`` maps it
instead. Measured on the 2-core machine of ``bench/RESULTS.md`` (``spark_session`` then a Delta create, append and
MERGE, pairs of runs): Spark's start 5.9-6.2 s without, 3.5-3.6 s with; the first Delta create 5.0-5.5 s without,
3.2-3.4 s with; the four steps 21.9-22.9 s without, 16.3-16.8 s with (12.1-12.4 against 18.3-18.8 s with the
tests' ``SHORT_LIVED_DRIVER_OPTIONS``). ``cdc_assets.lake.build_class_archive`` builds it (``scripts/setup.sh``).

Contract:
- ``with_class_archive(options, archive)`` is the driver's ``spark.driver.extraJavaOptions`` with
  ``-XX:SharedArchiveFile=<archive>`` added when ``archive`` exists and ``options`` neither name an archive nor turn
  sharing off (``-Xshare:off``): a user's setting wins. It never fails a start: Java checks the archive against its
  own build and the classpath, and when they differ (a JDK upgraded since ``scripts/setup.sh``) it prints one warning
  ("Unable to use shared archive") and loads classes as without an archive.
- ``archive_is_stale(archive, files)``: no archive, or one older than any of ``files`` (the jars on the driver's
  classpath, the ``java`` binary), by their modification or inode change time (a reinstalled file).
- The archive is an optimisation only: classes it lacks load as usual, nothing else in the JVM changes. The
  executors of a cluster master (``spark.executor.extraJavaOptions``) do not use it; only a local driver does.
"""

from __future__ import annotations

import shlex
from pathlib import Path

ARCHIVE_NAME = "spark-classes.jsa"
SHARED_ARCHIVE_OPTION = "-XX:SharedArchiveFile="
ARCHIVE_AT_EXIT_OPTION = "-XX:ArchiveClassesAtExit="
SHARING_OFF_OPTION = "-Xshare:off"


def with_class_archive(options: str, archive: Path | None) -> str:
    """``options`` (a driver's ``extraJavaOptions``) with the archive added (module Contract)."""
    if archive is None or not archive.is_file():
        return options
    words = shlex.split(options)
    if any(w.startswith((SHARED_ARCHIVE_OPTION, ARCHIVE_AT_EXIT_OPTION)) or w == SHARING_OFF_OPTION for w in words):
        return options
    return f"{options} {SHARED_ARCHIVE_OPTION}{archive}".strip()


def archive_is_stale(archive: Path, files: list[Path]) -> bool:
    """No archive at ``archive``, or one older than any of ``files``: modified or put in place (inode change time: a
    package manager keeps a file's modification time from the package, older than an archive made before) after it."""
    if not archive.is_file():
        return True
    made = archive.stat().st_mtime
    for file in files:
        try:
            status = file.stat()
        except FileNotFoundError:
            continue
        if max(status.st_mtime, status.st_ctime) > made:
            return True
    return False
