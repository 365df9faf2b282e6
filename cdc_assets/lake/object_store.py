"""Where a lake location lives, for pyarrow: a local disk or an S3-compatible object store.

Contract: ``arrow_filesystem(uri)`` returns ``(filesystem, path)``, the pyarrow file system that holds ``uri`` and
the path of ``uri`` inside it:

- a local path (relative paths are made absolute against the working directory) or a ``file://`` URI:
  ``pyarrow.fs.LocalFileSystem`` and the absolute local path;
- an ``s3a://bucket/key`` or ``s3://bucket/key`` URI: ``pyarrow.fs.S3FileSystem`` and ``bucket/key`` (pyarrow's S3
  paths: no scheme, no leading slash, no trailing slash). The endpoint is ``$AWS_ENDPOINT_URL`` when set (its scheme,
  ``http`` or ``https``, becomes the connection's; none: ``https``), else AWS's; the region ``$AWS_REGION``, else
  ``$AWS_DEFAULT_REGION``, else pyarrow's own resolution. Credentials are never passed here: pyarrow's default chain
  finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``~/.aws``, instance metadata);
  Spark's s3a client reads the same variables and endpoint (``cdc_assets.lake.spark.object_store_conf``). Buckets are
  neither created nor deleted through it.

Any other scheme (``gs://``, ``hdfs://``, ``http://``...) raises ``ValueError`` naming the scheme and the allowed
ones, as does an S3 URI without a bucket, or one that ``pathlib.Path`` collapsed (``s3a:/bucket/key``: keep an object
store's lake root a ``str``). Each call makes a new S3 file system (about 3 ms): derive children of a resolved
location from its ``path`` rather than resolving each again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

S3_SCHEMES = ("s3a", "s3")
ALLOWED_LOCATIONS = "a local path, file://, s3a:// (or s3://)"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"
REGION_ENVS = ("AWS_REGION", "AWS_DEFAULT_REGION")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_USER_INFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def shown(uri: str) -> str:
    """``uri`` for a message: user information (``user:password@``) before its host replaced by ``***@``."""
    return _USER_INFO.sub(r"\1***@", uri)


def location_scheme(uri: str) -> str:
    """The lower-case scheme of ``uri`` (``""`` for a local path). A scheme needs ``://`` after it, except
    ``file:``: ``c:/x`` or ``a:b`` are local names."""
    match = _SCHEME.match(uri)
    if match is None:
        return ""
    scheme = match.group(1).lower()
    if scheme == "file" or uri[len(scheme) + 1 :].startswith("//"):
        return scheme
    if scheme in S3_SCHEMES and uri[len(scheme) + 1 :].startswith("/"):  # what pathlib.Path makes of s3a://b/k
        raise ValueError(
            f"{shown(uri)!r} is not an {scheme}:// URI ({scheme}:/ with one slash: was it made a pathlib.Path,"
            " which collapses '//'? keep an object store location a str)"
        )
    return ""


def region_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$AWS_REGION``, else ``$AWS_DEFAULT_REGION``, else ``None`` (empty values count as unset)."""
    env = os.environ if environ is None else environ
    for name in REGION_ENVS:
        if env.get(name):
            return env[name]
    return None


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$AWS_ENDPOINT_URL`` (an empty value counts as unset), without a trailing slash."""
    env = os.environ if environ is None else environ
    endpoint = env.get(ENDPOINT_ENV, "").strip().rstrip("/")
    return endpoint or None


def s3_filesystem(environ: Mapping[str, str] | None = None) -> pafs.S3FileSystem:
    """An ``S3FileSystem`` for the endpoint and region the environment names (see the module's contract);
    credentials from pyarrow's default chain."""
    options: dict[str, str] = {}
    endpoint = endpoint_from_env(environ)
    if endpoint is not None:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"${ENDPOINT_ENV} must be an http:// or https:// URL with a host, got {shown(endpoint)!r}")
        options["endpoint_override"] = parts.netloc + parts.path
        options["scheme"] = parts.scheme
    region = region_from_env(environ)
    if region is not None:
        options["region"] = region
    return pafs.S3FileSystem(**options)


def arrow_filesystem(uri: str, environ: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system holding ``uri`` and the path inside it (see the module's contract); ``environ``
    (default ``os.environ``) supplies ``AWS_ENDPOINT_URL`` and the region."""
    text = os.fspath(uri)
    scheme = location_scheme(text)
    if scheme == "":
        return pafs.LocalFileSystem(), os.path.abspath(text)
    parts = urlsplit(text)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{shown(text)!r}: a file:// URI names no host (or localhost)")
        return pafs.LocalFileSystem(), os.path.abspath(unquote(parts.path) or "/")
    if scheme in S3_SCHEMES:
        bucket = parts.netloc
        if "@" in bucket:  # never echoed: it may hold a secret
            raise ValueError(f"{shown(text)!r}: an {scheme}:// URI holds no credentials (the environment does)")
        if not bucket:
            raise ValueError(f"{text!r}: an {scheme}:// URI needs a bucket ({scheme}://bucket/key)")
        key = unquote(parts.path).strip("/")
        return s3_filesystem(environ), f"{bucket}/{key}" if key else bucket
    raise ValueError(f"unsupported scheme {scheme!r} in {shown(text)!r}: a lake location is {ALLOWED_LOCATIONS}")
