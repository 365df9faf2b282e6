"""What the source database says about captured tables, the slot and the publication.

Contract:
- ``discover`` resolves the configured table list and include/exclude patterns to ``CapturedTable``s (columns from
  the catalog, key = primary key or configured surrogate key) and ``SkippedTable``s: **one table that cannot be
  captured never stops the others**. A table without a primary key and without a configured surrogate key, an
  unknown surrogate-key column, a listed table that does not exist, a table the role may not ``SELECT``, a leaf
  partition (captured through its root), a table with a column name holding a backtick (Delta's MERGE with
  Change Data Feed fails on it), or a table whose columns the codec refuses is skipped, each with its reason and
  the fix; ``discover_tables`` is ``discover(...).tables``. Partitioned tables are captured as their root
  (``relkind 'p'``): a read of the root covers every partition, and the stream maps a partition's changes to the
  root (``cdc_assets.sources.postgres.stream``). ``partitions_of`` lists a root's leaf partitions now.
- Qualified names are ``cdc_assets.engine.names.qualify(schema, name)``; every statement quotes identifiers with
  ``sql.Identifier``.
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
from cdc_assets.engine.names import qualify
from cdc_assets.sources.postgres.connection import SourceError
from cdc_assets.sources.postgres.pg_values import PgColumn, columns_from_catalog

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
        return qualify(self.schema, self.name)

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @property
    def key(self) -> tuple[PgColumn, ...]:
        by_name = {c.name: c for c in self.columns}
        return tuple(by_name[name] for name in self.key_columns)


@dataclass(frozen=True)
class SkippedTable:
    """A table the configuration selects but that cannot be captured: why, and what fixes it."""

    source: str
    schema: str
    name: str
    reason: str
    fix: str

    @property
    def qualified_name(self) -> str:
        return qualify(self.schema, self.name)

    @property
    def message(self) -> str:
        return f"table {self.qualified_name} is not captured: {self.reason}; fix: {self.fix}"


@dataclass(frozen=True)
class Discovery:
    tables: list[CapturedTable]
    skipped: list[SkippedTable]


def discover_tables(conn: psycopg.Connection, source: SourceConfig) -> list[CapturedTable]:
    return discover(conn, source).tables


def discover(conn: psycopg.Connection, source: SourceConfig) -> Discovery:
    rows = conn.execute(
        """
        select n.nspname, c.relname, c.relispartition, has_table_privilege(c.oid, 'SELECT'), rn.nspname, r.relname
        from pg_class c join pg_namespace n on n.oid = c.relnamespace
        left join pg_class r on c.relispartition and r.oid = pg_partition_root(c.oid)
        left join pg_namespace rn on rn.oid = r.relnamespace
        where c.relkind in ('r', 'p')
          and n.nspname not in ('pg_catalog', 'information_schema') and n.nspname not like 'pg\\_%%'
        order by 1, 2
        """
    ).fetchall()
    user = source.connection.user
    existing = {qualify(row[0], row[1]): (row[0], row[1]) for row in rows if not row[2]}
    leaves = {qualify(row[0], row[1]): qualify(row[4], row[5]) for row in rows if row[2]}
    readable = {qualify(row[0], row[1]) for row in rows if row[3]}
    chosen: dict[str, TableConfig] = {}
    skipped: dict[str, SkippedTable] = {}
    for table in source.tables:
        name = table.qualified_name
        if name in leaves:
            skipped[name] = SkippedTable(
                source.name, table.schema, table.name, f"it is a partition of {leaves[name]}",
                f"capture its root table {leaves[name]} instead (a partitioned table is captured as its root, "
                "with the changes of every partition)",
            )  # fmt: skip
        elif name not in existing:
            skipped[name] = SkippedTable(
                source.name, table.schema, table.name, f"it does not exist (or the role {user!r} cannot see it)",
                "create it, grant the role USAGE on its schema, or remove it from 'tables'",
            )  # fmt: skip
        else:
            chosen[name] = table
    for name, (schema, relname) in sorted(existing.items()):
        if name not in chosen and _matches(source.include, name):
            chosen[name] = TableConfig(schema=schema, name=relname)
    chosen = {name: table for name, table in chosen.items() if not _matches(source.exclude, name)}
    tables: list[CapturedTable] = []
    for name, table in chosen.items():
        if name not in readable:
            grant = sql.SQL("GRANT SELECT ON {} TO {}").format(
                sql.Identifier(table.schema, table.name), sql.Identifier(user)
            )
            skipped[name] = SkippedTable(
                source.name, table.schema, table.name, f"the role {user!r} may not SELECT from it",
                f"an administrator can run: {grant.as_string(conn)}; or exclude it",
            )  # fmt: skip
            continue
        try:
            tables.append(describe_table(conn, source, table))
        except CannotCapture as error:
            skipped[name] = SkippedTable(source.name, table.schema, table.name, error.reason, error.fix)
        except (LookupError, ValueError) as error:
            skipped[name] = SkippedTable(
                source.name, table.schema, table.name, f"its columns cannot be read: {error}",
                "change or exclude the column (or the table)",
            )  # fmt: skip
    return Discovery(tables, [skipped[name] for name in sorted(skipped)])


def _matches(patterns: Sequence[str], qualified_name: str) -> bool:
    """Whether an include/exclude pattern matches (``fnmatch``, case-sensitive; a pattern without a schema is one of
    ``public``)."""
    return any(fnmatch.fnmatchcase(qualified_name, p if "." in p else f"public.{p}") for p in patterns)


def selected(source: SourceConfig, schema: str, name: str) -> TableConfig | None:
    """The configuration ``discover`` would capture the table with: listed under ``tables``, or matching an
    ``include`` pattern, and matching no ``exclude`` pattern; None: the source does not select it."""
    qualified_name = qualify(schema, name)
    if _matches(source.exclude, qualified_name):
        return None
    for table in source.tables:
        if table.qualified_name == qualified_name:
            return table
    return TableConfig(schema=schema, name=name) if _matches(source.include, qualified_name) else None


def would_capture(conn: psycopg.Connection, source: SourceConfig, schema: str, name: str) -> bool:
    """Whether ``discover`` would capture the (non-partition) table now: selected, readable by the role, and
    describable (a key, usable column names and types). A stream batch asks this of a table it meets that its run
    does not capture (``cdc_assets.sources.postgres.stream``)."""
    table = selected(source, schema, name)
    if table is None:
        return False
    row = conn.execute(
        "select has_table_privilege(%s::regclass, 'SELECT')", [sql.Identifier(schema, name).as_string(conn)]
    ).fetchone()
    if row is None or not row[0]:
        return False
    try:
        describe_table(conn, source, table)
    except (CannotCapture, LookupError, ValueError):
        return False
    return True


class CannotCapture(SourceError):
    """A table that cannot be captured as configured: ``reason`` and ``fix`` (``discover`` skips it)."""

    def __init__(self, source: str, qualified_name: str, reason: str, fix: str) -> None:
        super().__init__(f"source {source!r}: table {qualified_name} {reason}; {fix}")
        self.reason = reason
        self.fix = fix


def partitions_of(conn: psycopg.Connection, table: CapturedTable) -> list[str]:
    """The qualified names of ``table``'s leaf partitions now (empty for an ordinary table)."""
    rows = conn.execute(
        """
        select n.nspname, c.relname from pg_partition_tree(%s::regclass) t
        join pg_class c on c.oid = t.relid join pg_namespace n on n.oid = c.relnamespace
        where t.isleaf and t.relid <> %s::regclass
        order by 1, 2
        """,
        [table.identifier.as_string(conn)] * 2,
    ).fetchall()
    return [qualify(schema, name) for schema, name in rows]


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
    unusable = sorted(name for name in names if "`" in name)
    if unusable:  # Delta's MERGE with Change Data Feed fails on them (INVALID_ATTRIBUTE_NAME_SYNTAX, packedCdc.`...`)
        raise CannotCapture(
            source.name, table.qualified_name, f"has column(s) {unusable} whose names hold a backtick, which Delta's "
            "MERGE with Change Data Feed cannot handle", "rename the column(s) or exclude the table",
        )  # fmt: skip
    if table.surrogate_key:
        unknown = [c for c in table.surrogate_key if c not in names]
        if unknown:
            raise CannotCapture(
                source.name, table.qualified_name, f"has no column {unknown[0]!r} of its surrogate_key",
                f"name existing columns in its surrogate_key; columns: {', '.join(sorted(names))}",
            )  # fmt: skip
        key = tuple(table.surrogate_key)
    elif primary:
        key = tuple(primary)
    else:
        raise CannotCapture(
            source.name, table.qualified_name, "has no primary key",
            "configure a surrogate_key (columns that identify a row uniquely) for it under 'tables', add a primary "
            "key, or exclude it",
        )  # fmt: skip
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
    # a partitioned table's partitions are listed instead of it unless publish_via_partition_root is set: count
    # each listed table's partition root as published too
    published = {
        qualify(schema, name)
        for schema, name in conn.execute(
            """
            select rn.nspname, r.relname
            from pg_publication_tables p
            join pg_namespace n on n.nspname = p.schemaname
            join pg_class c on c.relnamespace = n.oid and c.relname = p.tablename
            join pg_class r on r.oid = coalesce(pg_partition_root(c.oid), c.oid)
            join pg_namespace rn on rn.oid = r.relnamespace
            where p.pubname = %s
            union select schemaname, tablename from pg_publication_tables where pubname = %s
            """,
            [source.publication, source.publication],
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
