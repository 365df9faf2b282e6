"""How a failed stream batch is described (the message the UI shows first) and the settings of big batches."""

from __future__ import annotations

import psycopg
import pytest
from py4j.protocol import Py4JError, Py4JNetworkError

from cdc_assets.engine.batch_bounds import BatchBounds, after_failure
from cdc_assets.lake.spark import big_batch_conf
from cdc_assets.pipeline import (
    BatchProgress,
    SnapshotDriverError,
    describe_failure,
    driver_failure_named,
    failure_cause,
)  # fmt: skip

BOUNDS = BatchBounds(max_changes=500_000, max_bytes=256 << 20)


def test_a_dead_jvm_is_named_instead_of_py4js_connection_refused() -> None:
    try:
        try:
            raise Py4JNetworkError("An error occurred while trying to connect to the Java server")
        except Py4JNetworkError:
            raise ConnectionRefusedError(111, "Connection refused") from None
    except ConnectionRefusedError as error:
        cause = failure_cause(error)
    assert "JVM died" in cause and "heap" in cause


def test_a_databases_connection_refused_is_not_named_a_dead_jvm() -> None:
    refused = psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused'
    )
    assert failure_cause(refused).startswith("OperationalError: connection failed")


def test_a_snapshot_whose_driver_died_names_its_table_chunks_and_the_dead_jvm() -> None:
    what = "snapshot of table public.orders (source 'shop'), chunks 3, 4"
    with pytest.raises(SnapshotDriverError) as raised, driver_failure_named(what):
        raise Py4JError("Answer from Java side is empty")
    message = str(raised.value)
    assert message.startswith("snapshot of table public.orders (source 'shop'), chunks 3, 4 failed: the Spark driver's")
    assert "JVM died" in message and "Nothing of this attempt is applied" in message
    assert isinstance(raised.value.__cause__, Py4JError)
    with pytest.raises(KeyError), driver_failure_named(what):  # any other error passes through unchanged
        raise KeyError("x")


def test_heap_exhaustion_anywhere_in_the_chain_is_named() -> None:
    try:
        try:
            raise RuntimeError("java.lang.OutOfMemoryError: Java heap space")
        except RuntimeError as inner:
            raise ValueError("An error occurred while calling o123.execute") from inner
    except ValueError as error:
        assert failure_cause(error) == "the Spark driver's JVM ran out of heap (java.lang.OutOfMemoryError)"
    assert failure_cause(KeyError("x")) == "KeyError: 'x'"


def test_the_message_names_phase_table_sizes_and_settings() -> None:
    progress = BatchProgress(phase="merge", table="public.blobs", changes=1200, bytes=300 << 20, transactions=7)
    shrunk = after_failure(BOUNDS, progress.changes, progress.bytes, "heap")
    message = describe_failure("demo", progress, BOUNDS, shrunk, "the JVM ran out of heap", "6144m")
    assert message.startswith("stream batch of source 'demo' failed in phase merge of table public.blobs: ")
    assert "1200 changes in 7 transactions, 300.0 MB" in message
    assert "at most 600 changes, 128.0 MB" in message
    assert "spark.driver.memory (now 6144m)" in message and "stream.max_batch_bytes" in message
    single = BatchProgress(phase="changelog", table="public.blobs", changes=200, bytes=2 << 30, transactions=1)
    message = describe_failure("demo", single, BOUNDS, shrunk, "heap", "1024m")
    assert "single transaction and cannot be split: raise spark.driver.memory (now 1024m)" in message


def test_big_batches_avoid_broadcasts_and_write_small_row_groups_for_big_rows() -> None:
    spill = 32 << 20
    assert big_batch_conf(1 << 20, 5000, False, spill) == {}  # small batch of small rows: Spark's defaults
    big = big_batch_conf(2 << 30, 200, False, spill)
    assert big["spark.sql.autoBroadcastJoinThreshold"] == "-1"
    assert big["spark.sql.files.maxPartitionBytes"] == str(spill)
    assert big["parquet.block.size"] == str(2 << 20)
    many_small = big_batch_conf(100 << 20, 500_000, False, spill)
    assert "parquet.block.size" not in many_small and many_small["spark.sql.autoBroadcastJoinThreshold"] == "-1"
    assert big_batch_conf(1 << 20, 50, True, spill)["spark.sql.autoBroadcastJoinThreshold"] == "-1"
