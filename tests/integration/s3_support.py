"""The S3-compatible server of the tests: moto's server (``moto[server]``, the ``s3`` extra) in a thread of the test
process, on a free loopback port.

Contract: ``s3_server(bucket)`` is a context manager that starts ``moto.server.ThreadedMotoServer`` on 127.0.0.1 (port
0: the system picks a free one, read back from the bound socket), sets ``S3_ENV`` in ``os.environ`` (the endpoint
``AWS_ENDPOINT_URL``, dummy credentials ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` = ``testing``, ``AWS_REGION`` =
``us-east-1``; ``CLEARED_ENV`` removed so that nothing of a real account mixes in), creates ``bucket`` (boto3, which
moto depends on) and yields the endpoint URL; without moto, a ``RuntimeError`` naming ``EXTRAS=s3 scripts/setup.sh``.
The server's request log (logger ``werkzeug``: a line per request on stderr) is silenced below warnings meanwhile.
On exit the server is stopped, and the log level and every variable it touched get their previous values back (a
variable that was unset is removed again). The objects live in the server's memory: gone with it.
``bucket_keys(root)`` lists the keys under an ``s3a://bucket/prefix`` root while the server runs.

A process's environment reaches a JVM only when the JVM starts (a Spark driver started by PySpark copies it then):
a Spark session that must read these credentials through s3a's provider chain must start inside the block.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
CLEARED_ENV = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION")


@contextmanager
def s3_server(bucket: str) -> Iterator[str]:
    """Run the server with ``bucket`` in it; yields its endpoint URL (``http://127.0.0.1:PORT``)."""
    try:  # the s3 extra's: imported here so that the rest of the suite does not need it
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as error:
        raise RuntimeError(
            f"the S3 test server needs moto[server] ({error}): install the s3 extra, EXTRAS=s3 scripts/setup.sh"
            " (scripts/test.sh does)"
        ) from error

    request_log = logging.getLogger("werkzeug")  # one line per request on stderr otherwise
    log_level = request_log.level
    request_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = {name: os.environ.get(name) for name in (*S3_ENV, "AWS_ENDPOINT_URL", *CLEARED_ENV)}
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for name in CLEARED_ENV:
            os.environ.pop(name, None)
        os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": endpoint})
        boto3.client("s3", endpoint_url=endpoint, region_name=S3_ENV["AWS_REGION"]).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
        request_log.setLevel(log_level)


def bucket_keys(root: str) -> list[str]:
    """The keys under the ``s3a://bucket/prefix`` ``root``, relative to it (``prefix/`` removed)."""
    import boto3

    bucket, _, prefix = root.removeprefix("s3a://").partition("/")
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return [item["Key"].removeprefix(f"{prefix}/") for page in pages for item in page.get("Contents", [])]
