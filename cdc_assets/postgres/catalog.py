"""What the source database says about captured tables, the slot and the publication.

Contract:
- ``discover_tables`` resolves the configured table list and include/exclude patterns to ``CapturedTable``s
  (columns from the catalog, key = primary key or configured surrogate key). A table without a primary key and
  without a configured surrogate key, an unknown table, or an unknown surrogate-key column raises ``SourceError``
  naming the table.
- ``with_current_columns`` returns a captured table with the columns the catalog lists at the moment of the call
  (the key and settings unchanged). A chunk read calls it after its low watermark: every column added by an
  ``ALTER`` committed before the watermark is then read, whatever the run described when it started.
- ``filled_without_changes`` returns those of the named columns whose catalog entry gives rows written before the
  column existed a value without a change in the WAL: ``atthasmissing`` (a non-volatile ``DEFAULT``, stored once) or
  ``atthasdef`` (a volatile ``DEFAULT`` or a generated column, written by a table rewrite that logical decoding
  does not emit; also a ``DEFAULT`` set after an ``ADD COLUMN`` without one, a harmless false positive).
- ``check_replication_role`` refuses a role without the ``REPLICATION`` attribute (or superuser).
- ``ensure_publication`` / ``ensure_slot`` use an existing publication/slot as it is (checking that it covers the
  captured tables / uses ``pgoutput`` on this database), create it when missing and the role may, and otherwise
  raise ``SourceError`` with the statement an administrator can run. Nothing else is ever written to the source.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, replace

import psycopg
from psycopg import errors, sql

from cdc_assets.config import SourceConfig, TableConfig
from cdc_assets.engine.pg_values import PgColumn, columns_from_catalog
from cdc_assets.postgres.connection import SourceError

BYTE_ORDERED_COLLATIONS = {"C", "POSIX", "ucs_basic", "C.UTF-8", "C.utf8", "pg_c_utf8"}


@dataclass(frozen=True)
class CapturedTable:
    source: str
    schema: str
    name: str
    columns: tuple[PgColumn, ...]
    key_columns: tuple[str, ...]
    key_is_primary: bool
    byte_ordered_key: bool
    chunk_size: int

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @property
    def key(self) -> tuple[PgColumn, ...]:
        by_name = {c.name: c for c in self.columns}
        return tuple(by_name[name] for name in self.key_columns)

    @property
    def asset_name(self) -> str:
        return f"{self.source}__{self.schema}__{self.name}".lower()


def discover_tables(conn: psycopg.Connection, source: SourceConfig) -> list[CapturedTable]:
    rows = conn.execute(
        """
        select n.nspname, c.relname
        from pg_class c join pg_namespace n on n.oid = c.relnamespace
        where c.relkind in ('r', 'p') and not c.relispartition
          and n.nspname not in ('pg_catalog', 'information_schema') and n.nspname not like 'pg\\_%%'
        order by 1, 2
        """
    ).fetchall()
    existing = {f"{schema}.{name}" for schema, name in rows}
    chosen: dict[str, TableConfig] = {}
    for table in source.tables:
        if table.qualified_name not in existing:
            raise SourceError(
                f"source {source.name!r}: table {table.qualified_name} does not exist "
                f"(or the role {source.connection.user!r} cannot see it)"
            )
        chosen[table.qualified_name] = table
    for pattern in source.include:
        qualified_pattern = pattern if "." in pattern else f"public.{pattern}"
        for name in sorted(existing):
            if fnmatch.fnmatchcase(name, qualified_pattern) and name not in chosen:
                schema, relname = name.split(".", 1)
                chosen[name] = TableConfig(schema=schema, name=relname)
    for pattern in source.exclude:
        qualified_pattern = pattern if "." in pattern else f"public.{pattern}"
        for name in list(chosen):
            if fnmatch.fnmatchcase(name, qualified_pattern):
                del chosen[name]
    return [describe_table(conn, source, table) for table in chosen.values()]


def with_current_columns(conn: psycopg.Connection, table: CapturedTable) -> CapturedTable:
    """``table`` with its columns as the catalog lists them now (an autocommit connection: this statement's
    snapshot). The key must still be there; a key column dropped since raises ``SourceError`` naming it."""
    try:
        columns = tuple(columns_from_catalog(conn, table.schema, table.name))
    except LookupError as error:
        raise SourceError(f"source {table.source!r}: table {table.qualified_name}: {error}") from None
    if columns == table.columns:
        return table
    names = {c.name for c in columns}
    lost = [k for k in table.key_columns if k not in names]
    if lost:
        raise SourceError(
            f"source {table.source!r}: table {table.qualified_name}: key column(s) {lost} no longer exist; "
            "re-plan the table (remove its chunk plan and lake folder)"
        )
    return replace(table, columns=columns)


def filled_without_changes(conn: psycopg.Connection, table: CapturedTable, names: Sequence[str]) -> list[str]:
    if not names:
        return []
    rows = conn.execute(
        """
        select a.attname from pg_attribute a
        where a.attrelid = %s::regclass and a.attname = any(%s) and a.attnum > 0 and not a.attisdropped
          and (a.atthasmissing or a.atthasdef)
        order by a.attnum
        """,
        [table.identifier.as_string(conn), list(names)],
    ).fetchall()
    return [r[0] for r in rows]


def describe_table(conn: psycopg.Connection, source: SourceConfig, table: TableConfig) -> CapturedTable:
    columns = tuple(columns_from_catalog(conn, table.schema, table.name))
    primary = [
        row[0]
        for row in conn.execute(
            """
            select a.attname
            from pg_index i
            join pg_attribute a on a.attrelid = i.indrelid and a.attnum = any(i.indkey)
            where i.indrelid = %s::regclass and i.indisprimary
            order by array_position(i.indkey, a.attnum)
            """,
            [sql.Identifier(table.schema, table.name).as_string(conn)],
        ).fetchall()
    ]
    names = {c.name for c in columns}
    if table.surrogate_key:
        unknown = [c for c in table.surrogate_key if c not in names]
        if unknown:
            raise SourceError(
                f"source {source.name!r}: table {table.qualified_name}: surrogate_key column {unknown[0]!r} "
                f"does not exist; columns: {', '.join(sorted(names))}"
            )
        key = tuple(table.surrogate_key)
    elif primary:
        key = tuple(primary)
    else:
        raise SourceError(
            f"source {source.name!r}: table {table.qualified_name} has no primary key; configure a "
            "surrogate_key (columns that identify a row uniquely) for it under 'tables', or exclude it"
        )
    collations = conn.execute(
        """
        select a.attname, coalesce(nullif(co.collname, 'default'), d.datcollate)
        from pg_attribute a
        left join pg_collation co on co.oid = a.attcollation
        cross join (select datcollate from pg_database where datname = current_database()) d
        where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped and a.attcollation <> 0
        """,
        [sql.Identifier(table.schema, table.name).as_string(conn)],
    ).fetchall()
    key_collations = {name: collation for name, collation in collations if name in key}
    return CapturedTable(
        source=source.name,
        schema=table.schema,
        name=table.name,
        columns=columns,
        key_columns=key,
        key_is_primary=not table.surrogate_key,
        byte_ordered_key=all(c in BYTE_ORDERED_COLLATIONS for c in key_collations.values()),
        chunk_size=table.chunk_size or source.chunk_size,
    )


def check_replication_role(conn: psycopg.Connection, source: SourceConfig) -> None:
    row = conn.execute("select rolreplication or rolsuper from pg_roles where rolname = current_user").fetchone()
    if not row or not row[0]:
        raise SourceError(
            f"source {source.name!r}: role {source.connection.user!r} lacks the REPLICATION attribute, which "
            f"logical decoding needs; an administrator can run: ALTER ROLE {source.connection.user} REPLICATION"
        )


def ensure_publication(conn: psycopg.Connection, source: SourceConfig, tables: list[CapturedTable]) -> str:
    """Use, extend or create the publication; returns what was done ('existing', 'created', 'extended')."""
    row = conn.execute("select puballtables from pg_publication where pubname = %s", [source.publication]).fetchone()
    wanted = {t.qualified_name for t in tables}
    statement_tables = sql.SQL(", ").join(t.identifier for t in tables)
    if row is None:
        statement = sql.SQL("create publication {} for table {}").format(
            sql.Identifier(source.publication), statement_tables
        )
        return _administrative(conn, source, statement, f"publication {source.publication!r} does not exist")
    if row[0]:
        return "existing"
    published = {
        f"{schema}.{name}"
        for schema, name in conn.execute(
            "select schemaname, tablename from pg_publication_tables where pubname = %s", [source.publication]
        ).fetchall()
    }
    missing = [t for t in tables if t.qualified_name in wanted - published]
    if not missing:
        return "existing"
    statement = sql.SQL("alter publication {} add table {}").format(
        sql.Identifier(source.publication), sql.SQL(", ").join(t.identifier for t in missing)
    )
    reason = f"publication {source.publication!r} does not include {', '.join(t.qualified_name for t in missing)}"
    result = _administrative(conn, source, statement, reason)
    return "extended" if result == "created" else result


def ensure_slot(conn: psycopg.Connection, source: SourceConfig) -> str:
    row = conn.execute(
        "select plugin, database, slot_type from pg_replication_slots where slot_name = %s", [source.slot]
    ).fetchone()
    if row is not None:
        plugin, database, slot_type = row
        if slot_type != "logical" or plugin != "pgoutput" or database != source.connection.dbname:
            raise SourceError(
                f"source {source.name!r}: replication slot {source.slot!r} exists but is a {slot_type} slot "
                f"with plugin {plugin!r} on database {database!r}; it must be a logical 'pgoutput' slot on "
                f"{source.connection.dbname!r}: choose another 'slot' name"
            )
        return "existing"
    statement = sql.SQL("select pg_create_logical_replication_slot({}, 'pgoutput')").format(sql.Literal(source.slot))
    return _administrative(conn, source, statement, f"replication slot {source.slot!r} does not exist")


def _administrative(conn: psycopg.Connection, source: SourceConfig, statement: sql.Composed, reason: str) -> str:
    text = statement.as_string(conn)
    try:
        with conn.transaction():
            conn.execute(statement)
    except (
        errors.InsufficientPrivilege,
        errors.ReadOnlySqlTransaction,
        errors.ObjectNotInPrerequisiteState,
    ) as e:
        raise SourceError(
            f"source {source.name!r}: {reason} and role {source.connection.user!r} may not create it "
            f"({e.diag.message_primary}); an administrator can run: {text}"
        ) from None
    return "created"
