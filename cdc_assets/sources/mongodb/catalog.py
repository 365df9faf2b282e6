"""Which collections a MongoDB source captures, and how the lake holds their documents.

Contract:
- ``discover(client, source)``: the collections of ``source.mongodb.databases`` (none given: every database the user
  may list, except ``admin``, ``local`` and ``config``) whose ``database.collection`` matches an ``include`` pattern
  and no ``exclude`` pattern (``fnmatch``, case-sensitive), plus those named under ``tables``. A named collection
  that does not exist raises ``SourceError`` naming it and the fix; a view, a time-series collection and a
  ``system.*`` collection are skipped with reason and fix (no change stream, or not ours to capture).
- Lake columns of every collection (``ARROW_SCHEMA``): ``_id_key`` (the key: hex of ``bson_order.sort_key(_id)``;
  hex keeps the byte order, so Spark's string order of keys and chunk bounds is BSON order), ``_id`` (canonical
  extended JSON of the ``_id``), ``document`` (canonical extended JSON of the whole document), then one typed
  column per declared top-level field (``tables[].fields``, in declared order; ``typed_fields``), then
  ``_cdc_unrepresentable`` (field name -> canonical extended JSON of a declared field's value that does not fit its
  type; NULL when every value fits). ``CapturedCollection.arrow_schema`` is the collection's schema
  (``ARROW_SCHEMA`` without declared fields); ``document_row(doc, fields)`` makes one row of it.
- ``discover`` gives each captured collection the fields its ``tables`` entry declares (none otherwise).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pymongo

from cdc_assets.config import FieldConfig, SourceConfig
from cdc_assets.engine.names import qualify
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE
from cdc_assets.source import SourceError
from cdc_assets.sources.mongodb.bson_order import canonical_json, sort_key
from cdc_assets.sources.mongodb.typed_fields import arrow_fields, typed_values

KEY_COLUMN = "_id_key"
COLUMNS = (KEY_COLUMN, "_id", "document")
SOURCE_SCHEMA = pa.schema([(KEY_COLUMN, pa.string()), ("_id", pa.string()), ("document", pa.string())])
ARROW_SCHEMA = SOURCE_SCHEMA.append(pa.field(UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE))
SYSTEM_DATABASES = ("admin", "local", "config")


def arrow_schema(fields: tuple[FieldConfig, ...] = ()) -> pa.Schema:
    """The lake columns of a collection with these declared fields."""
    if not fields:
        return ARROW_SCHEMA
    return pa.schema([*SOURCE_SCHEMA, *arrow_fields(fields), pa.field(UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE)])


@dataclass(frozen=True)
class CapturedCollection:
    database: str
    collection: str
    fields: tuple[FieldConfig, ...] = ()  # declared top-level fields (typed columns)

    @property
    def arrow_schema(self) -> pa.Schema:
        return arrow_schema(self.fields)

    @property
    def column_names(self) -> list[str]:
        return [*COLUMNS, *(f.name for f in self.fields)]

    @property
    def qualified_name(self) -> str:
        return qualify(self.database, self.collection)

    @property
    def key_columns(self) -> tuple[str, ...]:
        return (KEY_COLUMN,)

    @property
    def namespace(self) -> tuple[str, str]:
        return self.database, self.collection


@dataclass(frozen=True)
class SkippedCollection:
    database: str
    collection: str
    reason: str
    fix: str

    @property
    def qualified_name(self) -> str:
        return qualify(self.database, self.collection)

    @property
    def message(self) -> str:
        return f"{self.qualified_name}: {self.reason}; fix: {self.fix}"


def id_key(value: Any) -> str:
    return sort_key(value).hex()


def document_row(document: dict[str, Any], fields: tuple[FieldConfig, ...] = ()) -> dict[str, Any]:
    _id = document["_id"]
    values, unrepresentable = typed_values(document, fields)
    return {KEY_COLUMN: id_key(_id), "_id": canonical_json(_id), "document": canonical_json(document), **values,
            UNREPRESENTABLE_COLUMN: None if unrepresentable is None else list(unrepresentable.items())}  # fmt: skip


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema = ARROW_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def discover(
    client: pymongo.MongoClient, source: SourceConfig
) -> tuple[list[CapturedCollection], list[SkippedCollection]]:
    options = source.mongodb
    databases = list(options.databases) if options is not None and options.databases else None
    if databases is None:
        databases = [d for d in client.list_database_names() if d not in SYSTEM_DATABASES]
    named = {(t.schema, t.name) for t in source.tables}
    declared: dict[tuple[str, str], tuple[FieldConfig, ...]] = {}
    for t in source.tables:
        declared.setdefault((t.schema, t.name), t.fields)
    for database, _ in sorted(named):
        if database not in databases:
            databases.append(database)
    captured: dict[tuple[str, str], CapturedCollection] = {}
    skipped: list[SkippedCollection] = []
    found: set[tuple[str, str]] = set()
    for database in sorted(set(databases)):
        for info in client[database].list_collections():
            name = info["name"]
            found.add((database, name))
            qualified = f"{database}.{name}"
            chosen = (database, name) in named or (
                any(fnmatch.fnmatchcase(qualified, p) for p in source.include)
                and not any(fnmatch.fnmatchcase(qualified, p) for p in source.exclude)
            )
            if not chosen:
                continue
            kind = info.get("type", "collection")
            if name.startswith("system."):
                skipped.append(SkippedCollection(database, name, "a system collection", "exclude it"))
            elif kind != "collection":
                skipped.append(SkippedCollection(
                    database, name, f"a {kind}, not a collection: it has no change stream of its own",
                    "capture the collections it reads instead, and exclude it",
                ))  # fmt: skip
            else:
                captured[(database, name)] = CapturedCollection(database, name, declared.get((database, name), ()))
    missing = sorted(named - found)
    if missing:
        database, name = missing[0]
        raise SourceError(
            f"source {source.name!r}: collection {database}.{name} (under tables) does not exist in database "
            f"{database!r}; create it or remove it from the source's tables"
        )
    return [captured[k] for k in sorted(captured)], skipped
