"""Lake locations without a server: which store ``arrow_filesystem`` picks and the path inside it, the schemes it
refuses (never echoing a credential), and what ``object_store_conf``/``object_store_jars`` give Spark for a lake root.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from cdc_assets.config import SparkConfig
from cdc_assets.lake.object_store import arrow_filesystem, location_scheme
from cdc_assets.lake.spark import S3_JARS_ENV, driver_conf, is_s3a, object_store_conf, object_store_jars

NO_ENV: dict[str, str] = {}
LOCAL_ENDPOINT = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000/", "AWS_REGION": "eu-west-1"}
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
    "AWS_SESSION_TOKEN": "t0ken-value",
}


def s3_options(filesystem: pafs.FileSystem) -> dict[str, Any]:
    """The options an ``S3FileSystem`` was made with (what pickling it keeps)."""
    assert isinstance(filesystem, pafs.S3FileSystem)
    return filesystem.__reduce__()[1][0]


def test_local_paths_and_file_uris_are_the_local_file_system_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for location, path in [
        (str(tmp_path / "lake"), str(tmp_path / "lake")),
        ("lake/sub", str(tmp_path / "lake" / "sub")),
        (f"file://{tmp_path}/a%20b", f"{tmp_path}/a b"),
        (f"FILE://localhost{tmp_path}/x", f"{tmp_path}/x"),
        (f"file:{tmp_path}/y", f"{tmp_path}/y"),
        ("c:x", str(tmp_path / "c:x")),  # no "//": a local name
    ]:
        filesystem, inside = arrow_filesystem(location, NO_ENV)
        assert isinstance(filesystem, pafs.LocalFileSystem), location
        assert inside == path, location


def test_s3_uris_are_bucket_and_key_with_the_endpoint_and_region_of_the_environment() -> None:
    for location, path in [
        ("s3a://bucket/lake/", "bucket/lake"),
        ("S3A://bucket/lake/t/part-0.parquet", "bucket/lake/t/part-0.parquet"),
        ("s3://bucket", "bucket"),
    ]:
        filesystem, inside = arrow_filesystem(location, {**LOCAL_ENDPOINT, **CREDENTIALS})
        assert inside == path, location
        options = s3_options(filesystem)
        assert (options["endpoint_override"], options["scheme"], options["region"]) == (
            "127.0.0.1:9000",
            "http",
            "eu-west-1",
        )
        # credentials are left to pyarrow's default chain, never passed explicitly
        assert (options["access_key"], options["secret_key"], options["session_token"]) == (None, None, None)
    options = s3_options(arrow_filesystem("s3a://b/k", {"AWS_DEFAULT_REGION": "ap-south-1"})[0])
    assert (options["endpoint_override"], options["scheme"], options["region"]) == ("", "https", "ap-south-1")
    env = {"AWS_ENDPOINT_URL": "minio.example:9443", "AWS_REGION": "us-west-2", "AWS_DEFAULT_REGION": "ap-south-1"}
    options = s3_options(arrow_filesystem("s3a://b/k", env)[0])
    assert (options["endpoint_override"], options["scheme"], options["region"]) == (
        "minio.example:9443",
        "https",
        "us-west-2",
    )


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("gs://x", r"unsupported scheme 'gs' in 'gs://x': a lake location is a local path, file://, s3a://"),
        ("hdfs://nn:8020/lake", r"unsupported scheme 'hdfs'"),
        ("abfss://c@acct.dfs.core.windows.net/x", r"unsupported scheme 'abfss' in 'abfss://\*\*\*@acct"),
        ("s3a:/bucket/lake", r"not an s3a:// URI .*pathlib\.Path"),
        (str(Path("s3a://bucket/lake")), r"not an s3a:// URI"),
        ("s3a:///lake", r"needs a bucket"),
        ("s3a://AKIDEXAMPLE:s3cr3t-value@bucket/lake", r"'s3a://\*\*\*@bucket/lake'.*holds no credentials"),
        ("file://otherhost/x", r"names no host"),
    ],
)
def test_other_locations_are_refused_naming_why_and_never_a_credential(location: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        arrow_filesystem(location, NO_ENV)
    assert "s3cr3t" not in str(refused.value)


def test_bad_endpoints_are_refused() -> None:
    with pytest.raises(ValueError, match=r"AWS_ENDPOINT_URL must be an http:// or https:// URL"):
        arrow_filesystem("s3a://b/k", {"AWS_ENDPOINT_URL": "ftp://host:21"})


def test_location_schemes() -> None:
    assert [location_scheme(u) for u in ("/x", "x", "c:/x", "file:/x", "S3A://b", "s3://b", "gs://b")] == [
        *("", "", "", "file", "s3a", "s3", "gs"),
    ]


def test_object_store_conf_sets_endpoint_and_region_for_an_s3a_root_and_never_credentials() -> None:
    local = {
        "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.endpoint.region": "eu-west-1",
    }
    assert object_store_conf("s3a://bucket/lake", {**LOCAL_ENDPOINT, **CREDENTIALS}) == local
    https = {"AWS_ENDPOINT_URL": "https://s3.example.com", "AWS_DEFAULT_REGION": "ap-south-1"}
    assert object_store_conf("s3a://bucket/lake", https) == {
        "spark.hadoop.fs.s3a.endpoint": "https://s3.example.com",
        "spark.hadoop.fs.s3a.endpoint.region": "ap-south-1",
    }
    assert object_store_conf("s3a://bucket/lake", {**CREDENTIALS, "AWS_ENDPOINT_URL": ""}) == {}  # AWS, its chain
    for root in (None, "/srv/lake", Path("/srv/lake"), "file:///srv/lake", "s3://bucket/lake"):
        assert object_store_conf(root, {**LOCAL_ENDPOINT, **CREDENTIALS}) == {}, root
    assert is_s3a("s3a://b") and is_s3a("S3A://b/x") and not is_s3a("/s3a://b") and not is_s3a(None)
    with pytest.raises(ValueError, match="pathlib"):
        object_store_conf(Path("s3a://bucket/lake"), NO_ENV)


def test_object_store_jars_only_for_an_s3a_root_and_a_clear_error_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(S3_JARS_ENV, str(tmp_path))
    assert object_store_jars("/srv/lake") == [] and object_store_jars(None) == []
    (tmp_path / "hadoop-aws-3.4.1.jar").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"bundle-\*\.jar\) in .*EXTRAS=s3 scripts/setup\.sh"):
        object_store_jars("s3a://bucket/lake")
    (tmp_path / "bundle-2.24.6.jar").write_bytes(b"")
    assert object_store_jars("s3a://bucket/lake") == [  # used where they lie: never copied per application
        f"local:{tmp_path / 'bundle-2.24.6.jar'}",
        f"local:{tmp_path / 'hadoop-aws-3.4.1.jar'}",
    ]
    monkeypatch.delenv(S3_JARS_ENV)
    monkeypatch.setenv("CDC_JARS_DIR", str(tmp_path / "elsewhere"))  # the s3 jars' default: its s3/ folder
    with pytest.raises(RuntimeError, match=re.escape(f"{tmp_path / 'elsewhere' / 's3'}: an s3a:// lake root needs")):
        object_store_jars("s3a://bucket/lake")


def test_the_drivers_conf_has_the_s3a_jars_and_settings_for_an_s3a_root_and_the_users_conf_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("hadoop-aws-3.4.1.jar", "bundle-2.24.6.jar"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setenv(S3_JARS_ENV, str(tmp_path))
    for name, value in {**LOCAL_ENDPOINT, **CREDENTIALS}.items():
        monkeypatch.setenv(name, value)
    local = driver_conf(SparkConfig(), "/srv/lake")
    assert "s3a" not in local["spark.jars"] and not any("fs.s3a" in key for key in local)
    conf = driver_conf(SparkConfig(), "s3a://bucket/lake")
    assert conf["spark.jars"] == ",".join(
        [local["spark.jars"], f"local:{tmp_path / 'bundle-2.24.6.jar'}", f"local:{tmp_path / 'hadoop-aws-3.4.1.jar'}"]
    )
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert not any(value in text for value in CREDENTIALS.values() for text in (*conf, *conf.values()))
    user = {"spark.hadoop.fs.s3a.endpoint": "https://other.example", "spark.hadoop.fs.s3a.path.style.access": "false"}
    conf = driver_conf(SparkConfig(conf=user), "s3a://bucket/lake")
    assert (conf["spark.hadoop.fs.s3a.endpoint"], conf["spark.hadoop.fs.s3a.path.style.access"]) == (
        "https://other.example",
        "false",
    )
