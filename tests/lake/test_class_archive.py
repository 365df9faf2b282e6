"""The driver's class archive: when it is added to the JVM options, when it is stale, and that a driver started by
``spark_session`` maps it (the last one starts a driver in a child process: this process runs the suite's own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cdc_assets.config import SparkConfig
from cdc_assets.lake.build_class_archive import classpath_files
from cdc_assets.lake.class_archive import ARCHIVE_NAME, archive_is_stale, with_class_archive
from cdc_assets.lake.spark import DRIVER_JAVA_OPTIONS, SHORT_LIVED_DRIVER_OPTIONS, class_archive_path, driver_conf

ROOT = Path(__file__).resolve().parents[2]


def test_the_archive_is_added_to_the_options_only_when_it_exists_and_the_options_name_none(tmp_path: Path) -> None:
    archive = tmp_path / ARCHIVE_NAME
    assert with_class_archive("-Xmx1g", archive) == "-Xmx1g"  # not built
    assert with_class_archive("-Xmx1g", None) == "-Xmx1g"
    archive.write_bytes(b"x")
    expected = f"-Xmx1g -XX:+UseSerialGC -XX:SharedArchiveFile={archive}"
    assert with_class_archive("-Xmx1g -XX:+UseSerialGC", archive) == expected
    assert with_class_archive("", archive) == f"-XX:SharedArchiveFile={archive}"
    for own in ("-XX:SharedArchiveFile=/elsewhere.jsa", "-XX:ArchiveClassesAtExit=/new.jsa", "-Xshare:off"):
        assert with_class_archive(f"-Xmx1g {own}", archive) == f"-Xmx1g {own}"  # the user's setting wins


def test_an_archive_is_stale_when_missing_or_older_than_a_file_it_was_made_from(tmp_path: Path) -> None:
    jar, archive = tmp_path / "a.jar", tmp_path / ARCHIVE_NAME
    jar.write_bytes(b"jar")
    assert archive_is_stale(archive, [jar])
    archive.write_bytes(b"archive")
    os.utime(archive, (time.time() + 30, time.time() + 30))  # made after the jar was put in place
    assert not archive_is_stale(archive, [jar, tmp_path / "gone.jar"])
    installed = tmp_path / "b.jar"  # a package's file: put in place now, modified long ago
    installed.write_bytes(b"jar")
    os.utime(installed, (time.time() - 86400, time.time() - 86400))
    os.utime(archive, (time.time() - 60, time.time() - 60))
    assert archive_is_stale(archive, [installed])
    os.utime(archive, (time.time() + 30, time.time() + 30))
    os.utime(jar, (time.time() + 60, time.time() + 60))  # the jar replaced after the archive was made
    assert archive_is_stale(archive, [jar])


def test_a_local_drivers_conf_names_the_archive_beside_the_users_own_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_JARS_DIR", str(tmp_path))
    (tmp_path / "delta-spark_2.13-4.0.1.jar").write_bytes(b"jar")
    user = SparkConfig(conf={DRIVER_JAVA_OPTIONS: SHORT_LIVED_DRIVER_OPTIONS})
    assert driver_conf(user)[DRIVER_JAVA_OPTIONS] == SHORT_LIVED_DRIVER_OPTIONS  # no archive built there
    (tmp_path / ARCHIVE_NAME).write_bytes(b"x")
    named = f"{SHORT_LIVED_DRIVER_OPTIONS} -XX:SharedArchiveFile={tmp_path / ARCHIVE_NAME}"
    assert driver_conf(user)[DRIVER_JAVA_OPTIONS] == named
    assert driver_conf(user, use_class_archive=False)[DRIVER_JAVA_OPTIONS] == SHORT_LIVED_DRIVER_OPTIONS
    assert driver_conf(SparkConfig())[DRIVER_JAVA_OPTIONS].endswith(f"-XX:SharedArchiveFile={tmp_path / ARCHIVE_NAME}")


def test_setup_built_an_archive_that_a_driver_started_by_spark_session_loads_spark_and_delta_from(
    tmp_path: Path,
) -> None:
    archive = class_archive_path()
    assert not archive_is_stale(archive, classpath_files()), f"scripts/setup.sh builds {archive}"
    log = tmp_path / "classes.log"
    child = textwrap.dedent(f"""
        from cdc_assets.config import SparkConfig
        from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS, spark_session
        options = SHORT_LIVED_DRIVER_OPTIONS + " -Xlog:class+load=info:file={log}"
        spark = spark_session(SparkConfig(master="local[1]", conf={{"spark.driver.extraJavaOptions": options}}))
        spark.range(3).write.format("delta").save({str(tmp_path / "t")!r})
        spark.stop()
    """)
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True, capture_output=True, timeout=300)
    sources = {}
    for line in log.read_text().splitlines():
        name, _, source = line.partition(" source: ")
        sources[name.rsplit(" ", 1)[-1]] = source
    for name in ("org.apache.spark.SparkContext", "org.apache.spark.sql.delta.DeltaLog"):
        assert sources.get(name) == "shared objects file (top)", (name, sources.get(name))
