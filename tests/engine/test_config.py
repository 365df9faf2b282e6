from pathlib import Path

import pytest

from cdc_assets.config import ConfigError, parse_config

BASE = {
    "lake_root": "lake",
    "sources": [
        {
            "name": "demo",
            "kind": "postgres",
            "connection": {"host": "127.0.0.1", "dbname": "d", "user": "u", "password": "${PGPW}"},
            "tables": ["public.orders", {"name": "events", "surrogate_key": ["a", "b"]}],
        }
    ],
}


def parse(raw: dict, env: dict | None = None):
    return parse_config(raw, Path("/tmp"), env if env is not None else {"PGPW": "s3cret"})


def test_valid_config_and_secret_never_printed() -> None:
    config = parse(BASE)
    source = config.source("demo")
    assert source.connection.password is not None and source.connection.password.value == "s3cret"
    assert "s3cret" not in repr(config)
    assert source.tables[1].qualified_name == "public.events"
    assert source.tables[1].surrogate_key == ("a", "b")
    assert config.lake_root == Path("/tmp/lake")


def test_an_object_store_lake_root_is_kept_as_its_uri_and_other_schemes_are_refused() -> None:
    assert parse({**BASE, "lake_root": "s3a://lake-bucket/cdc/"}).lake_root == "s3a://lake-bucket/cdc"
    assert parse({**BASE, "lake_root": "file:///data/lake"}).lake_root == Path("/data/lake")
    with pytest.raises(ConfigError, match="lake_root: scheme 'gs' is not supported; allowed: a local path, or a URI"):
        parse({**BASE, "lake_root": "gs://bucket/lake"})
    with pytest.raises(ConfigError, match="lake_root: 's3a:///lake' names no bucket"):
        parse({**BASE, "lake_root": "s3a:///lake"})


def test_unknown_key_is_named() -> None:
    raw = {**BASE, "sources": [{**BASE["sources"][0], "chunk_sise": 5}]}
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.chunk_sise; allowed keys here: .*chunk_size"):
        parse(raw)


def test_literal_password_refused() -> None:
    source = {**BASE["sources"][0], "connection": {**BASE["sources"][0]["connection"], "password": "plain"}}
    with pytest.raises(ConfigError, match="password: must come from the environment") as info:
        parse({**BASE, "sources": [source]})
    assert "plain" not in str(info.value)


def test_missing_environment_variable_named() -> None:
    with pytest.raises(ConfigError, match="environment variable PGPW is not set"):
        parse(BASE, env={})


def test_startup_mode_values() -> None:
    bad = {**BASE, "sources": [{**BASE["sources"][0], "startup_mode": "earliest"}]}
    with pytest.raises(ConfigError, match="allowed: initial, latest, snapshot, timestamp"):
        parse(bad)
    timestamp = {**BASE, "sources": [{**BASE["sources"][0], "startup_mode": "timestamp"}]}
    with pytest.raises(ConfigError, match="slot cannot start in the past"):
        parse(timestamp)


def with_stream(stream: dict) -> dict:
    return {**BASE, "sources": [{**BASE["sources"][0], "stream": stream}]}


def test_stream_upkeep_settings() -> None:
    default = parse(BASE).source("demo").stream
    assert (default.compact_seconds, default.vacuum_seconds, default.compact_target_mb) == (3600, 86400, 64)
    off = parse(with_stream({"compact_seconds": 0, "vacuum_seconds": 0, "run_seconds": 0})).source("demo").stream
    assert (off.compact_seconds, off.vacuum_seconds, off.run_seconds) == (0, 0, 0)
    for key in ("compact_seconds", "vacuum_seconds"):
        with pytest.raises(ConfigError, match=rf"stream\.{key}: expected 0 \(off\) or a positive integer"):
            parse(with_stream({key: -1}))
    with pytest.raises(ConfigError, match=r"stream\.compact_target_mb: expected a positive integer, got 0"):
        parse(with_stream({"compact_target_mb": 0}))


def with_checks(checks: object) -> dict:
    return {**BASE, "sources": [{**BASE["sources"][0], "checks": checks}]}


def test_consistency_sweep_cron() -> None:
    assert parse(BASE).source("demo").checks.cron == "0 3 * * *"
    assert parse(with_checks({"cron": "30  2 * * 1"})).source("demo").checks.cron == "30 2 * * 1"
    for off in ("off", False, None):  # YAML reads a bare off as false
        assert parse(with_checks({"cron": off})).source("demo").checks.cron is None
    with pytest.raises(ConfigError, match=r"sources\[0\]\.checks\.cron: '0 3 \* \*' is not a cron expression; "
                                          r"allowed: five fields \(minute, hour"):  # fmt: skip
        parse(with_checks({"cron": "0 3 * *"}))
    with pytest.raises(ConfigError, match=r"unknown key sources\[0\]\.checks\.every; allowed keys here: "
                                          r"chunks_per_window, cron"):  # fmt: skip
        parse(with_checks({"every": "day"}))


def test_chunks_per_window_of_a_range_check() -> None:
    assert parse(BASE).source("demo").checks.chunks_per_window == 8
    assert parse(with_checks({"chunks_per_window": 3, "cron": "off"})).source("demo").checks.chunks_per_window == 3
    for bad in (0, -2, "many", 1.5):
        with pytest.raises(ConfigError, match=r"sources\[0\]\.checks\.chunks_per_window: expected a positive "
                                              r"integer, got "):  # fmt: skip
            parse(with_checks({"chunks_per_window": bad}))


def test_stream_byte_bounds_and_lag_alerts_are_read_and_validated() -> None:
    stream = {"max_batch_bytes": 1024, "spill_bytes": 512, "max_lag_alert_bytes": 10, "max_lag_alert_seconds": 60}
    config = parse({**BASE, "sources": [{**BASE["sources"][0], "stream": stream}]})
    settings = config.source("demo").stream
    assert (settings.max_batch_bytes, settings.spill_bytes) == (1024, 512)
    assert (settings.max_lag_alert_bytes, settings.max_lag_alert_seconds) == (10, 60)
    bad = {**BASE, "sources": [{**BASE["sources"][0], "stream": {"max_batch_bytes": 0}}]}
    with pytest.raises(ConfigError, match=r"stream\.max_batch_bytes: expected a positive integer, got 0"):
        parse(bad)


def test_the_sensors_wait_for_a_source_is_bounded_below_dagsters_tick_limit() -> None:
    assert parse(BASE).source("demo").stream.sensor_timeout_seconds == 30
    with_timeout = {**BASE, "sources": [{**BASE["sources"][0], "stream": {"sensor_timeout_seconds": 12}}]}
    assert parse(with_timeout).source("demo").stream.sensor_timeout_seconds == 12
    for bad, message in ((0, "expected a positive integer, got 0"), (55, "55 is too long; allowed: 1 to 50 seconds")):
        too_long = {**BASE, "sources": [{**BASE["sources"][0], "stream": {"sensor_timeout_seconds": bad}}]}
        with pytest.raises(ConfigError, match=rf"sources\[0\]\.stream\.sensor_timeout_seconds: {message}"):
            parse(too_long)


def test_a_stream_runs_bound_in_flight_is_its_handoff_lead_run_seconds_and_overrun_or_none_when_off() -> None:
    from sensors.stream import MAX_RETRIES_TAG, MAX_RUNTIME_TAG, PRIORITY_TAG, stream_run_tags

    default = parse(BASE).source("demo").stream
    assert (default.run_seconds, default.max_overrun_seconds, default.max_runtime_seconds) == (0, 1800, 1800)
    assert (default.handoff_seconds, default.handoff_lead_seconds) == (120, 0)  # one batch per run: no successor early
    long_lived = parse(with_stream({"run_seconds": 600, "max_overrun_seconds": 300})).source("demo").stream
    assert long_lived.handoff_lead_seconds == 120
    assert long_lived.max_runtime_seconds == 1020  # a successor waits up to its lead for the pool
    short = parse(with_stream({"run_seconds": 30, "handoff_seconds": 60})).source("demo").stream
    assert short.handoff_lead_seconds == 15  # at most half of run_seconds
    no_handoff = parse(with_stream({"run_seconds": 600, "handoff_seconds": 0})).source("demo").stream
    assert (no_handoff.handoff_lead_seconds, no_handoff.max_runtime_seconds) == (0, 2400)
    with pytest.raises(ConfigError, match=r"stream\.handoff_seconds: expected 0 \(off\) or a positive integer"):
        parse(with_stream({"handoff_seconds": -1}))
    assert stream_run_tags(long_lived, "slot holds changes") == {
        "cdc/reason": "slot holds changes",
        MAX_RUNTIME_TAG: "1020",
        MAX_RETRIES_TAG: "0",  # the sensor requests the next run itself; the instance's default would retry it
        PRIORITY_TAG: "1",  # before snapshot (0) and sweep (-1) runs in the queue
    }
    unbounded = parse(with_stream({"run_seconds": 600, "max_overrun_seconds": 0})).source("demo").stream
    assert unbounded.max_runtime_seconds is None
    assert stream_run_tags(unbounded, "slot holds changes") == {
        "cdc/reason": "slot holds changes",
        MAX_RUNTIME_TAG: "0",  # written out: the instance's default bound (run_monitoring.max_runtime_seconds) is not 0
        MAX_RETRIES_TAG: "0",
        PRIORITY_TAG: "1",
    }
    with pytest.raises(ConfigError, match=r"stream\.max_overrun_seconds: expected 0 \(off\) or a positive integer"):
        parse(with_stream({"max_overrun_seconds": -5}))


def test_table_names_keep_case_and_spaces_and_quote_parts_with_dots() -> None:
    from cdc_assets.config import ConfigError, split_table_name

    assert split_table_name("orders", "t") == ("public", "orders")
    assert split_table_name("public.Order Items", "t") == ("public", "Order Items")
    assert split_table_name('"my.schema"."t.1"', "t") == ("my.schema", "t.1")
    assert split_table_name('"x.y"', "t") == ("public", "x.y")
    assert split_table_name('public."say ""hi"""', "t") == ("public", 'say "hi"')
    for bad in ("a.b.c", '"a', ".a"):
        with pytest.raises(ConfigError, match=r"tables\[0\]\.name: .* is not a table name; expected 'schema.table'"):
            split_table_name(bad, "tables[0].name")


@pytest.mark.parametrize(("key", "default", "value"), [("chunks_per_run", 4, 10), ("planner_interval_seconds", 30, 5)])
def test_a_sources_positive_integer_settings_are_read_and_validated(key: str, default: int, value: int) -> None:
    assert getattr(parse(BASE).source("demo"), key) == default
    assert getattr(parse({**BASE, "sources": [{**BASE["sources"][0], key: value}]}).source("demo"), key) == value
    for bad in (0, -1, "many", 2.5):
        with pytest.raises(ConfigError, match=rf"sources\[0\]\.{key}: expected a positive integer"):
            parse({**BASE, "sources": [{**BASE["sources"][0], key: bad}]})


@pytest.mark.parametrize(
    ("key", "default", "value"), [("snapshot_run_retries", 3, 5), ("snapshot_run_max_runtime_seconds", 21600, 600)]
)
def test_a_sources_snapshot_run_bounds_are_read_and_zero_turns_them_off(key: str, default: int, value: int) -> None:
    assert getattr(parse(BASE).source("demo"), key) == default
    for given in (value, 0):
        assert getattr(parse({**BASE, "sources": [{**BASE["sources"][0], key: given}]}).source("demo"), key) == given
    for bad in (-1, "many", 2.5, True):
        with pytest.raises(ConfigError, match=rf"sources\[0\]\.{key}: expected 0 \(off\) or a positive integer"):
            parse({**BASE, "sources": [{**BASE["sources"][0], key: bad}]})
