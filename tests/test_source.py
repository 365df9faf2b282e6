"""``cdc_assets.source``: the PostgreSQL pipeline is a ``CdcSource`` (the generic pipeline over PostgreSQL's
dialect), a MongoDB source the generic pipeline over ``MongoDialect``; a kind without an implementation is named."""

import dataclasses
from functools import cached_property
from pathlib import Path

import pytest

from cdc_assets.config import parse_config
from cdc_assets.dialect import SourceDialect
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.source import CdcSource
from cdc_assets.sources import UnsupportedSourceError, open_source
from cdc_assets.sources.mongodb.dialect import MongoDialect
from cdc_assets.sources.postgres.dialect import PostgresDialect
from cdc_assets.sources.postgres.pipeline import PostgresPipeline

RAW = {
    "lake_root": "lake",
    "sources": [
        {
            "name": "shop",
            "kind": "postgres",
            "connection": {"host": "127.0.0.1", "dbname": "d", "user": "u", "password": "${PGPW}"},
            "tables": ["public.orders"],
        }
    ],
}


def test_postgres_source_opens_as_a_cdc_source(tmp_path: Path) -> None:
    config = parse_config(RAW, tmp_path, {"PGPW": "s3cret"})
    source = open_source(config, config.source("shop"))  # connects to nothing until an operation runs
    assert isinstance(source, PostgresPipeline) and isinstance(source, CdcPipeline)
    assert isinstance(source.dialect, PostgresDialect)
    assert source.source.name == "shop"
    assert source.lake.root.local_path == tmp_path / "lake" / "shop"


def test_every_interface_operation_is_implemented_by_postgres() -> None:
    operations = [name for name in vars(CdcSource) if not name.startswith("_") and callable(vars(CdcSource)[name])]
    assert {"prepare", "plan", "snapshot", "stream_batch", "acknowledge", "pending_work", "check_chunks"} <= set(
        operations
    )
    for name in operations:
        assert callable(getattr(PostgresPipeline, name)), name
    assert isinstance(vars(CdcPipeline)["tables"], cached_property)  # resolved once, by prepare()
    # the PostgreSQL class adds nothing to the algorithm: only its constructor and a connection for inspection
    assert set(vars(PostgresPipeline)) - {"__module__", "__doc__", "__annotations__", "__parameters__",
                                          "__orig_bases__", "__firstlineno__", "__static_attributes__"} == {
        "__init__", "connect"}  # fmt: skip


def test_every_dialect_operation_is_implemented_by_postgres() -> None:
    operations = [n for n in vars(SourceDialect) if not n.startswith("_") and callable(vars(SourceDialect)[n])]
    assert {"discover", "window", "read_batch", "acknowledge", "position", "validate_offset", "pending"} <= set(
        operations
    )
    for name in operations:
        assert callable(getattr(PostgresDialect, name)), name


def test_a_mongodb_source_opens_as_the_generic_pipeline_over_mongo_dialect(tmp_path: Path) -> None:
    raw = {"lake_root": "lake", "sources": [{"name": "docs", "kind": "mongodb", "connection": {"uri": "${MONGO}"},
                                            "include": ["shop.*"]}]}  # fmt: skip
    config = parse_config(raw, tmp_path, {"MONGO": "mongodb://u:secret@127.0.0.1:1/?directConnection=true"})
    source = open_source(config, config.source("docs"))  # connects to nothing until an operation runs
    assert type(source) is CdcPipeline
    assert isinstance(source.dialect, MongoDialect)
    assert source.dialect.control.local_path == tmp_path / "lake" / "docs" / "_cdc"
    assert "secret" not in source.dialect.describe()
    operations = [n for n in vars(SourceDialect) if not n.startswith("_") and callable(vars(SourceDialect)[n])]
    for name in operations:
        assert callable(getattr(MongoDialect, name)), name


def test_a_kind_without_implementation_is_refused_by_name(tmp_path: Path) -> None:
    config = parse_config(RAW, tmp_path, {"PGPW": "s3cret"})
    mysql = dataclasses.replace(config.source("shop"), kind="mysql")
    with pytest.raises(
        UnsupportedSourceError, match=r"source 'shop': kind 'mysql' has no implementation; allowed: postgres, mongodb"
    ):
        open_source(config, mysql)
