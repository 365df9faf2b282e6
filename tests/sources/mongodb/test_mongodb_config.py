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
        ConfigError, match=r"startup_mode: 'earliest' is not allowed; allowed: initial, latest, snapshot, timestamp"
    ):
        parse({**SOURCE, "startup_mode": "earliest"})
    with pytest.raises(ConfigError, match=r"kind: 'mysql' is not supported; allowed: postgres, mongodb"):
        parse({**SOURCE, "kind": "mysql"})
    with pytest.raises(ConfigError, match=r"on_history_lost: 'skip' is not allowed; allowed: fail, resnapshot"):
        parse({**SOURCE, "mongodb": {"on_history_lost": "skip"}})


def test_pre_images_are_off_unless_asked_for_and_their_mode_is_validated() -> None:
    assert parse(SOURCE).source("docs").mongodb.full_document_before_change == "off"
    for mode in ("whenAvailable", "required", "off"):
        options = parse({**SOURCE, "mongodb": {"full_document_before_change": mode}}).source("docs").mongodb
        assert options.full_document_before_change == mode
    assert parse({**SOURCE, "mongodb": {"full_document_before_change": False}}).source("docs").mongodb == MongoOptions()
    with pytest.raises(ConfigError, match=r"sources\[0\]\.mongodb\.full_document_before_change: 'always' is not "
                                          r"allowed; allowed: off, whenAvailable, required"):  # fmt: skip
        parse({**SOURCE, "mongodb": {"full_document_before_change": "always"}})


def test_every_startup_mode_and_the_history_lost_option() -> None:
    for mode in ("initial", "latest", "snapshot"):
        source = parse({**SOURCE, "startup_mode": mode}).source("docs")
        assert (source.startup_mode, source.startup_timestamp) == (mode, None)
    assert parse(SOURCE).source("docs").mongodb.on_history_lost == "fail"
    options = parse({**SOURCE, "mongodb": {"on_history_lost": "resnapshot"}}).source("docs").mongodb
    assert options == MongoOptions(on_history_lost="resnapshot")


@pytest.mark.parametrize(
    ("given", "kept"), [("1795724544", "1795724544"), (" 1795724544:12 ", "1795724544:12"), (1795724544, "1795724544")]
)
def test_a_timestamp_start_takes_a_cluster_time(given, kept) -> None:
    source = parse({**SOURCE, "startup_mode": "timestamp", "startup_timestamp": given}).source("docs")
    assert (source.startup_mode, source.startup_timestamp) == ("timestamp", kept)


@pytest.mark.parametrize("bad", ["", "x", "1:2:3", "-1", "1.5", "4294967296", "1:4294967296", 107743472640 + 12, True])
def test_a_timestamp_start_in_another_form_is_refused_naming_the_forms(bad) -> None:
    # 107743472652 is what YAML 1.1 makes of an unquoted 1795724544:12 (base 60)
    with pytest.raises(ConfigError, match=r"startup_timestamp: .* is not SEC or SEC:ORD .*quote SEC:ORD in YAML"):
        parse({**SOURCE, "startup_mode": "timestamp", "startup_timestamp": bad})


def test_a_timestamp_start_needs_its_timestamp_and_only_it_reads_one() -> None:
    with pytest.raises(ConfigError, match=r"startup_timestamp: required with startup_mode: timestamp; allowed: SEC"):
        parse({**SOURCE, "startup_mode": "timestamp"})
    with pytest.raises(ConfigError, match=r"startup_timestamp: only read with startup_mode: timestamp \(the mode is"):
        parse({**SOURCE, "startup_mode": "latest", "startup_timestamp": "1795724544"})
    postgres = {"name": "pg", "kind": "postgres", "connection": {"host": "h", "dbname": "d", "user": "u"},
                "include": ["public.*"], "startup_mode": "timestamp", "startup_timestamp": "1"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"'timestamp' is not possible for PostgreSQL"):
        parse(postgres)
