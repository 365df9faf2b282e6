"""The PostgreSQL source against a real server: decoding, the watermark rule's premises, planning, errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from cdc_assets.config import ConfigError, PostgresConnection, Secret, SourceConfig, StreamConfig, TableConfig
from cdc_assets.sources.postgres.catalog import (
    check_replication_role,
    describe_table,
    discover,
    discover_tables,
    ensure_publication,
    ensure_slot,
    with_current_columns,
)
from cdc_assets.sources.postgres.connection import SourceError, connect
from cdc_assets.sources.postgres.lsn import SHORT_PAGE_HEADER, format_lsn, parse_lsn
from cdc_assets.sources.postgres.pgoutput import Begin, Commit, PgOutputDecoder, RowChange
from cdc_assets.sources.postgres.snapshot import chunk_select, plan_chunks, take_high_watermark, take_low_watermark
from cdc_assets.sources.postgres.stream import current_flush_lsn
from cdc_assets.sources.postgres.watermark import settled_at_low_watermark, widen_xid
from tests.integration.support import PG_PORT

DATABASE = "source_test"
PASSWORD = "pw-Z9q"


@pytest.fixture(scope="module")
def admin(postgres_server: dict[str, str]) -> Iterator[psycopg.Connection]:
    dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    root = psycopg.connect(f"{dsn} dbname=postgres", autocommit=True)
    root.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(DATABASE)))
    for slot in root.execute("select slot_name from pg_replication_slots where database = %s", [DATABASE]):
        root.execute("select pg_drop_replication_slot(%s)", [slot[0]])
    root.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
    for role in ("srctest_reader", "srctest_norepl"):
        root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
    root.execute(sql.SQL("create role srctest_reader login replication password {}").format(sql.Literal(PASSWORD)))
    root.execute(sql.SQL("create role srctest_norepl login password {}").format(sql.Literal(PASSWORD)))
    conn = psycopg.connect(f"{dsn} dbname={DATABASE}", autocommit=True)
    conn.execute(
        """
        create table ints (id bigint primary key, v text);
        create table pairs (a int, b text, v int, primary key (a, b));
        create table uuids (id uuid primary key, v int);
        create table lines (order_id bigint, line_no int, v text, primary key (order_id, line_no));
        create table nums (id numeric primary key, v int);
        create table nokey (x int, y int);
        insert into ints select g, 'v' || g from generate_series(1, 2500) g;
        insert into pairs select g % 7, 'k' || g, g from generate_series(1, 1000) g;
        insert into uuids select md5(g::text)::uuid, g from generate_series(1, 999) g;
        insert into lines select o, l, 'l' || o from generate_series(1, 400) o, generate_series(1, 3) l;
        insert into nums select g * 1.5, g from generate_series(1, 1500) g;
        grant select on all tables in schema public to srctest_reader, srctest_norepl;
        alter role srctest_reader set default_transaction_read_only = on;
        create publication admin_pub for table ints, pairs, uuids;
        """
    )
    conn.execute("select pg_create_logical_replication_slot('admin_slot', 'pgoutput')")
    try:
        yield conn
    finally:
        conn.close()
        for slot in root.execute("select slot_name from pg_replication_slots where database = %s", [DATABASE]):
            root.execute("select pg_drop_replication_slot(%s)", [slot[0]])
        root.execute(sql.SQL("drop database {} with (force)").format(sql.Identifier(DATABASE)))
        root.close()


def source_config(user: str = "srctest_reader", **overrides: object) -> SourceConfig:
    fields: dict[str, object] = {
        "name": "t",
        "kind": "postgres",
        "connection": PostgresConnection("127.0.0.1", PG_PORT, DATABASE, user, Secret(PASSWORD)),
        "slot": "admin_slot",
        "publication": "admin_pub",
        "startup_mode": "initial",
        "chunk_size": 300,
        "read_parallelism": 2,
        "tables": (TableConfig("public", "ints"), TableConfig("public", "pairs"), TableConfig("public", "uuids")),
        "include": (),
        "exclude": (),
        "stream": StreamConfig(),
    }
    fields.update(overrides)
    return SourceConfig(**fields)  # type: ignore[arg-type]


def peek(conn: psycopg.Connection, slot: str, publication: str) -> list:
    decoder = PgOutputDecoder()
    rows = conn.execute(
        "select data from pg_logical_slot_peek_binary_changes(%s, null, null, "
        "'proto_version', '1', 'publication_names', %s)",
        [slot, publication],
    ).fetchall()
    return [decoder.decode(row[0]) for row in rows]


def test_savepoint_changes_carry_top_level_xid_and_settled_rule_holds(admin: psycopg.Connection) -> None:
    """DESIGN.md: logical decoding reports the top-level xid under SAVEPOINT; xip lists top-level xids."""
    admin.execute("set synchronous_commit = on")
    reader = connect(source_config().connection, "t")
    writer = psycopg.connect(admin.info.dsn, autocommit=False)
    try:
        _savepoint_scenario(reader, writer, admin)
    finally:
        writer.close()
        reader.close()


def _savepoint_scenario(reader: psycopg.Connection, writer: psycopg.Connection, admin: psycopg.Connection) -> None:
    writer.execute("set synchronous_commit = on")  # the test cluster defaults to off; decoding reads flushed WAL
    writer.execute("insert into ints values (100001, 'outer')")
    writer.execute("savepoint s1")
    writer.execute("update ints set v = 'in-savepoint' where id = 1")
    writer.execute("release savepoint s1")
    (top_xid,) = writer.execute("select pg_current_xact_id()::text::bigint").fetchone()
    lw = take_low_watermark(reader)  # the writer is in progress: unsettled
    # in progress at LW: either listed in xip or at/above xmax (xmax is latestCompletedXid + 1)
    assert top_xid in lw.xip or top_xid >= lw.xmax
    assert not settled_at_low_watermark(top_xid, lw)
    writer.commit()
    changes = [m for m in peek(admin, "admin_slot", "admin_pub") if isinstance(m, RowChange)]
    mine = [c for c in changes if c.new and c.new[0] in ("100001", "1")]
    assert {c.new[1] for c in mine} == {"outer", "in-savepoint"}
    (reference,) = reader.execute("select pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    assert {widen_xid(c.begin.xid, reference) for c in mine} == {top_xid}
    lw_after = take_low_watermark(reader)
    assert settled_at_low_watermark(top_xid, lw_after)  # committed before this LW: visible to reads after it
    assert reader.execute("select v from ints where id = 1").fetchone() == ("in-savepoint",)
    high = take_high_watermark(reader)
    commit = [m for m in peek(admin, "admin_slot", "admin_pub") if isinstance(m, Commit)][-1]
    assert commit.end_lsn <= high  # a visible transaction's commit record ends before the high watermark


def insert_lsn(conn: psycopg.Connection) -> int:
    """The raw ``pg_current_wal_insert_lsn()`` (where the next record will start)."""
    return parse_lsn(conn.execute("select pg_current_wal_insert_lsn()::text").fetchone()[0])


def emit(admin: psycopg.Connection, payload: int) -> None:
    """A non-transactional logical message of ``payload`` bytes: WAL without a transaction id, flushed soon after
    (its statement's end asks the WAL writer to)."""
    admin.execute("select pg_logical_emit_message(false, 'pad', repeat('x', %s))", [payload])


def end_the_wal_at_a_pages_end(admin: psycopg.Connection, block: int) -> int:
    """Pad the WAL with logical messages until the inserted WAL ends exactly at a page's end; that position.

    A message of ``n`` payload bytes takes ``n + h`` bytes rounded up to a multiple of 8; ``header``, measured as
    ``size - 1000``, is ``h`` rounded up alike. Record positions are multiples of 8, so ``room - header`` bytes of
    payload fill the ``room`` left on the page exactly."""
    header = None
    for _ in range(40):  # other WAL (autovacuum, the checkpointer) may come between: measure and try again
        before = insert_lsn(admin)
        room = block - before % block
        if header is None or room - header < 300:  # above 255 bytes a payload's length takes one encoding
            if room < 3000:
                emit(admin, room + 500)  # onto the next page (a record may span pages)
                continue
            emit(admin, 1000)
            header = insert_lsn(admin) - before - 1000
            continue
        emit(admin, room - header)
        if insert_lsn(admin) == before + room + SHORT_PAGE_HEADER:
            return before + room
    raise AssertionError("could not end the WAL at a page's end in 40 tries")


def test_the_high_watermark_on_an_idle_server_is_reached_when_the_wal_ends_at_a_pages_end(
    admin: psycopg.Connection,
) -> None:
    """A suite run met it: the last record ended exactly at a page's end, ``pg_current_wal_insert_lsn()`` named the
    next page's first record (past its 24-byte header), and the server's flush position stayed at the page's end
    while nothing more was written: a window with that high watermark was never reached by the stream of an idle
    server. The high watermark is the end of the inserted WAL, which the flush reaches."""
    (block,) = admin.execute("select current_setting('wal_block_size')::int").fetchone()
    reader = connect(source_config().connection, "t")
    try:
        for _ in range(5):
            page_end = end_the_wal_at_a_pages_end(admin, block)
            deadline = time.monotonic() + 10
            while current_flush_lsn(admin) < page_end and time.monotonic() < deadline:
                time.sleep(0.05)
            high = take_high_watermark(reader)
            if insert_lsn(admin) == page_end + SHORT_PAGE_HEADER:  # nothing was written meanwhile
                break
        else:
            raise AssertionError("other WAL came between every try")
        flush = current_flush_lsn(admin)
        assert flush == page_end, (format_lsn(flush), format_lsn(page_end))
        assert high == page_end, (format_lsn(high), format_lsn(page_end))  # not past the next page's header
    finally:
        reader.close()


def test_begin_and_commit_frame_every_change(admin: psycopg.Connection) -> None:
    admin.execute("delete from pairs where a = 0 and b = 'k7'")
    admin.execute("update pairs set b = 'moved' where a = 1 and b = 'k1'")
    messages = peek(admin, "admin_slot", "admin_pub")
    kinds = [type(m).__name__ for m in messages]
    assert kinds[0] == "Begin" and kinds[-1] == "Commit"
    deletes = [m for m in messages if isinstance(m, RowChange) and m.op == "d"]
    assert deletes and deletes[-1].old_is_key_only and deletes[-1].old[:2] == ("0", "k7")
    key_change = next(m for m in messages if isinstance(m, RowChange) and m.op == "u" and m.new[1] == "moved")
    assert key_change.old is not None and key_change.old[:2] == ("1", "k1")
    assert all(isinstance(m, Begin | Commit) or m.begin is not None for m in messages if not hasattr(m, "columns"))


@pytest.mark.parametrize("table", ["ints", "pairs", "uuids", "lines", "nums"])
def test_chunk_plan_covers_every_row_exactly_once(admin: psycopg.Connection, table: str) -> None:
    """Every row in exactly one chunk; a plan made by scanning the key index (keys other than one integer column:
    composite, numeric, uuid) cuts a chunk every ``chunk_size`` keys in the key's own order. Ordered by the bounds'
    text instead (``select id::text ... order by id`` sorts by the output column), 1200 order lines of composite
    integer keys were cut into 4 chunks of 300, 300, 300 and 300 rows only by luck of the digits; the demo's 600
    lines with chunks of 30 became 11 chunks, one of 330 rows."""
    config = source_config()
    reader = connect(config.connection, "t")
    captured = describe_table(reader, config, TableConfig("public", table, chunk_size=300))
    plan = plan_chunks(reader, captured)
    assert len(plan.chunks) >= 3
    seen: list[tuple] = []
    sizes: list[int] = []
    for chunk in plan.chunks:
        key = sql.SQL(", ").join(sql.Identifier(c) for c in captured.key_columns)
        query = sql.SQL("select {} from ({}) c").format(key, chunk_select(captured, chunk.lo, chunk.hi))
        rows = reader.execute(query).fetchall()
        seen += rows
        sizes.append(len(rows))
    if table != "ints":  # planned by scanning the key index
        assert sizes[:-1] == [300] * (len(sizes) - 1) and 0 < sizes[-1] <= 300, sizes
    everything = reader.execute(
        sql.SQL("select {} from {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in captured.key_columns), captured.identifier
        )
    ).fetchall()
    assert len(seen) == len(everything) == len(set(seen))
    assert set(seen) == set(everything)
    reader.close()


def test_read_only_role_uses_existing_slot_and_publication(admin: psycopg.Connection) -> None:
    config = source_config()
    reader = connect(config.connection, "t")
    assert reader.execute("show default_transaction_read_only").fetchone() == ("on",)
    check_replication_role(reader, config)
    tables = discover_tables(reader, config)
    assert [t.qualified_name for t in tables] == ["public.ints", "public.pairs", "public.uuids"]
    assert ensure_publication(reader, config, tables) == "existing"
    assert ensure_slot(reader, config) == "existing"
    reader.close()


def test_missing_publication_refused_with_admin_statement_missing_slot_created(admin: psycopg.Connection) -> None:
    config = source_config(publication="nope_pub", slot="own_slot")
    reader = connect(config.connection, "t")
    tables = discover_tables(reader, config)
    with pytest.raises(SourceError, match=r"publication 'nope_pub' does not exist .* create publication"):
        ensure_publication(reader, config, tables)
    assert admin.execute("select count(*) from pg_publication where pubname = 'nope_pub'").fetchone() == (0,)
    # a REPLICATION role may create its own slot, even with default_transaction_read_only = on
    assert ensure_slot(reader, config) == "created"
    assert ensure_slot(reader, config) == "existing"
    admin.execute("select pg_drop_replication_slot('own_slot')")
    reader.close()


def test_a_table_that_cannot_be_captured_is_skipped_by_name_and_the_others_are_captured(
    admin: psycopg.Connection,
) -> None:
    """No key, an unknown surrogate-key column, no SELECT, a listed partition, a listed table that does not exist:
    each is skipped with its reason and fix, and every other table is captured (failed on the old code: the first
    such table raised for the whole source)."""
    admin.execute(
        """
        create table secret (id int primary key);
        create table meas (id int, at date, v int, primary key (id, at)) partition by range (at);
        create table meas_2025 partition of meas for values from ('2025-01-01') to ('2026-01-01');
        grant select on meas, meas_2025 to srctest_reader;
        """
    )
    try:
        listed = ("nokey", "secret", "meas_2025", "gone")
        config = source_config(
            tables=(TableConfig("public", "ints"), *(TableConfig("public", name) for name in listed)),
            include=("public.m*",),
        )
        reader = connect(config.connection, "t")
        found = discover(reader, config)
        assert [t.qualified_name for t in found.tables] == ["public.ints", "public.meas"]  # the root, not its leaf
        reasons = {t.qualified_name: (t.reason, t.fix) for t in found.skipped}
        assert sorted(reasons) == ["public.gone", "public.meas_2025", "public.nokey", "public.secret"]
        assert reasons["public.nokey"][0] == "has no primary key" and "surrogate_key" in reasons["public.nokey"][1]
        assert "may not SELECT" in reasons["public.secret"][0]
        assert 'GRANT SELECT ON "public"."secret" TO "srctest_reader"' in reasons["public.secret"][1]
        assert reasons["public.meas_2025"][0] == "it is a partition of public.meas"
        assert "does not exist" in reasons["public.gone"][0]
        with_key = source_config(tables=(TableConfig("public", "nokey", surrogate_key=("x", "zz")),))
        ((skipped,),) = [discover(reader, with_key).skipped]
        assert skipped.reason == "has no column 'zz' of its surrogate_key" and "columns: x, y" in skipped.fix
        with_key = source_config(tables=(TableConfig("public", "nokey", surrogate_key=("x",)),))
        assert [t.key_columns for t in discover_tables(reader, with_key)] == [("x",)]
        reader.close()
    finally:
        admin.execute("drop table secret, meas")


def test_with_current_columns_sees_an_added_column_and_names_a_lost_key(admin: psycopg.Connection) -> None:
    """A chunk read re-describes the columns after its low watermark (``with_current_columns``): an added column is
    read, an unchanged table is returned as it is, and a key column that is gone is named."""
    admin.execute("create table reshaped (a int, b int, v text, primary key (a, b))")
    admin.execute("grant select on reshaped to srctest_reader")
    try:
        config = source_config(tables=(TableConfig("public", "reshaped"),))
        reader = connect(config.connection, "t")
        (described,) = discover_tables(reader, config)
        assert with_current_columns(reader, described) is described
        admin.execute("alter table reshaped add column extra numeric(6, 2) default 1.5")
        current = with_current_columns(reader, described)
        assert [c.name for c in current.columns] == ["a", "b", "v", "extra"]
        assert current.columns[3].type_name == "numeric(6,2)" and current.key_columns == ("a", "b")
        admin.execute("alter table reshaped drop column b")
        with pytest.raises(SourceError, match=r"table public\.reshaped: key column\(s\) \['b'\] no longer exist"):
            with_current_columns(reader, described)
        reader.close()
    finally:
        admin.execute("drop table reshaped")


def test_role_without_replication_refused(admin: psycopg.Connection) -> None:
    config = source_config(user="srctest_norepl")
    conn = connect(config.connection, "t")
    with pytest.raises(SourceError, match="lacks the REPLICATION attribute"):
        check_replication_role(conn, config)
    conn.close()


def test_unreachable_database_and_bad_password_never_leak_secret() -> None:
    unreachable = PostgresConnection("127.0.0.1", 1, DATABASE, "srctest_reader", Secret(PASSWORD), connect_timeout=2)
    with pytest.raises(SourceError, match=r"cannot connect to postgresql://srctest_reader@127\.0\.0\.1:1/") as info:
        connect(unreachable, "t")
    assert PASSWORD not in str(info.value)
    wrong = PostgresConnection("127.0.0.1", PG_PORT, DATABASE, "srctest_reader", Secret("wrong-" + PASSWORD))
    with pytest.raises(SourceError, match="password authentication failed") as info:
        connect(wrong, "t")
    assert PASSWORD not in str(info.value)


def test_config_error_type_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_bad_input_fails_clearly_and_moves_no_offset(admin: psycopg.Connection, tmp_path) -> None:
    from cdc_assets.config import CdcConfig, SparkConfig
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline

    admin.execute("set synchronous_commit = on")
    admin.execute("update ints set v = v || '' where id < 10")  # changes wait in the slot
    slot_before = admin.execute(
        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = 'admin_slot'"
    ).fetchone()
    unreachable = PostgresConnection("127.0.0.1", 1, DATABASE, "srctest_reader", Secret(PASSWORD), connect_timeout=2)
    cases = [
        (
            source_config(publication="nope_pub"),
            r"publication 'nope_pub' does not exist and role 'srctest_reader' may not",
        ),
        (
            source_config(connection=unreachable),
            r"source 't': cannot connect to postgresql://srctest_reader@127\.0\.0\.1:1",
        ),
        (source_config(user="srctest_norepl"), r"role 'srctest_norepl' lacks the REPLICATION attribute"),
    ]
    for config, message in cases:
        pipeline = PostgresPipeline(CdcConfig(tmp_path, SparkConfig(), (config,)), config)
        with pytest.raises(SourceError, match=message) as info:
            pipeline.stream_batch(None, None, "bad-input")  # type: ignore[arg-type]  # fails before Spark is used
        assert PASSWORD not in str(info.value)
    slot_after = admin.execute(
        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = 'admin_slot'"
    ).fetchone()
    assert slot_after == slot_before
    assert not list(tmp_path.rglob("*")), "nothing may be written to the lake"
    # a table without a key is no bad input for the source: it is skipped by name, and the source prepares
    keyless = source_config(tables=(TableConfig("public", "nokey"),))
    pipeline = PostgresPipeline(CdcConfig(tmp_path, SparkConfig(), (keyless,)), keyless)
    assert pipeline.prepare() == {}
    assert [t.message for t in pipeline.skipped()] == [
        "table public.nokey is not captured: has no primary key; fix: configure a surrogate_key (columns that "
        "identify a row uniquely) for it under 'tables', add a primary key, or exclude it"
    ]
