"""The ``kind: mongodb`` section of the configuration: the connection string only from the environment and never
printed, per-kind keys named in errors, supported modes named."""

from pathlib import Path

import pytest

from cdc_assets.config import ConfigError, MongoConnection, MongoOptions, parse_config, redact_uri

URI = "mongodb://reader:pa55word@db1.example:27017,db2.example:27017/?replicaSet=rs0&authSource=admin"
SOURCE = {
    "name": "docs",
    "kind": "mongodb",
    "connection": {"uri": "${CDC_MONGODB_URI}", "server_selection_timeout_ms": 500},
    "include": ["shop.*"],
    "exclude": ["shop.tmp_*"],
    "mongodb": {"databases": ["shop"]},
    "chunk_size": 1000,
}


def parse(source: dict, env: dict | None = None):
    raw = {"lake_root": "lake", "sources": [source]}
    return parse_config(raw, Path("/tmp"), {"CDC_MONGODB_URI": URI} if env is None else env)


def test_a_mongodb_source_parses_and_never_prints_its_connection_string() -> None:
    source = parse(SOURCE).source("docs")
    assert source.kind == "mongodb"
    assert isinstance(source.connection, MongoConnection)
    assert source.connection.uri.value == URI
    assert source.connection.server_selection_timeout_ms == 500
    assert source.mongodb == MongoOptions(databases=("shop",), full_document="updateLookup")
    assert source.include == ("shop.*",) and source.exclude == ("shop.tmp_*",) and source.chunk_size == 1000
    assert "pa55word" not in repr(source) and "reader" not in repr(source)
    assert "pa55word" not in source.connection.describe()
    assert (
        source.connection.describe()
        == "mongodb://***@db1.example:27017,db2.example:27017/?replicaSet=rs0&authSource=admin"
    )


def test_redaction_of_password_options() -> None:
    assert redact_uri("mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:abc&tls=true") == (
        "mongodb://h/?authMechanismProperties=***&tls=true"
    )
    assert redact_uri("mongodb+srv://u:p@cluster.example/db") == "mongodb+srv://***@cluster.example/db"
    assert redact_uri("not a uri") == "***"


def test_a_literal_connection_string_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match=r"connection\.uri: must come from the environment") as info:
        parse({**SOURCE, "connection": {"uri": URI}})
    assert "pa55word" not in str(info.value)


def test_an_environment_value_that_is_no_connection_string_is_named_without_its_value() -> None:
    with pytest.raises(ConfigError, match=r"CDC_MONGODB_URI.*allowed: mongodb://\.\.\. or mongodb\+srv://") as info:
        parse(SOURCE, env={"CDC_MONGODB_URI": "postgres://secret@h"})
    assert "secret" not in str(info.value)


def test_postgres_keys_are_refused_for_mongodb_naming_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.slot; allowed keys here: .*mongodb") as info:
        parse({**SOURCE, "slot": "cdc_docs"})
    assert "publication" not in str(info.value).split("allowed keys here:")[1]
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.connection\.host; allowed keys here: .*uri"):
        parse({**SOURCE, "connection": {"uri": "${CDC_MONGODB_URI}", "host": "h"}})
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.mongodb\.pre_images; allowed keys here: "):
        parse({**SOURCE, "mongodb": {"pre_images": True}})


def test_the_mongodb_section_is_refused_for_postgres() -> None:
    postgres = {"name": "pg", "kind": "postgres", "connection": {"host": "h", "dbname": "d", "user": "u"},
                "include": ["public.*"], "mongodb": {}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.mongodb; allowed keys here: .*slot"):
        parse(postgres)


def test_unsupported_modes_are_named_with_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"full_document: 'whenAvailable' is not supported; allowed: updateLookup"):
        parse({**SOURCE, "mongodb": {"full_document": "whenAvailable"}})
    with pytest.raises(
        ConfigError, match=r"startup_mode: 'latest' is not implemented for MongoDB yet; allowed: initial"
    ):
        parse({**SOURCE, "startup_mode": "latest"})
    with pytest.raises(ConfigError, match=r"kind: 'mysql' is not supported; allowed: postgres, mongodb"):
        parse({**SOURCE, "kind": "mysql"})
