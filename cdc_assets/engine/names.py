"""Names: a source table's real name to Dagster names, lake folder names and back.

Contract (pure functions, no Dagster, no database):
- ``qualify(schema, name)`` is the captured table's qualified name, the key every part of the project uses
  (window log, plans, markers, ``CdcSource.tables``): ``schema.name`` as it always was when neither part holds a
  ``.`` or a ``"``; a part that does is double-quoted with ``"`` doubled, as PostgreSQL writes it, so a schema
  ``a.b`` with table ``c`` (``"a.b".c``) and schema ``a`` with table ``b.c`` (``a."b.c"``) stay apart.
  ``split_qualified`` reverses it exactly and raises ``ValueError`` for text that is not one.
- ``dagster_part(text)`` is a valid Dagster name part (``^[A-Za-z0-9_]+$``): the text itself when it already is
  one (and does not end like a hashed part), otherwise its invalid characters replaced by ``_``, cut to
  ``PART_PREFIX_CHARS`` characters, and ``_`` + the first ``HASH_HEX`` hex digits of the SHA-256 of the real text
  appended. The result depends on the text alone (stable: adding a table never renames another), parts that need
  no hash never end like one, and two different texts give the same part only on a hash collision (40 bits), so
  distinct names never collide in practice. Case is kept (PostgreSQL's ``Orders`` and ``orders`` differ).
- ``table_slug(schema, name)`` names a table in one Dagster name (partition set, job and schedule names):
  ``schema__name`` when both parts are valid, hold no ``__``, neither start nor end with ``_`` and the name does
  not end like a hash (so the join splits back at its one ``__``); otherwise both parts squeezed (invalid
  characters and runs of ``_`` to one ``_``), cut, joined, and ``_`` + a hash of the qualified name appended.
  ``lake_folder(schema, name)`` is ``dagster_part(schema).dagster_part(name)``: for ordinary names the
  ``schema.table`` folder of earlier versions, and a single path segment for any name.
- ``file_token(qualified_name)`` / ``from_file_token``: a reversible file-name form of a qualified name (percent
  encoding; ordinary names unchanged), for marker and plan file names.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import quote, unquote

VALID_PART = re.compile(r"^[A-Za-z0-9_]+$")
INVALID_CHARACTERS = re.compile(r"[^A-Za-z0-9_]")
HASH_HEX = 10
HASHED_ENDING = re.compile(rf"_[0-9a-f]{{{HASH_HEX}}}$")
PART_PREFIX_CHARS = 40


def _quote_part(part: str) -> str:
    if "." in part or '"' in part or part == "":
        return '"' + part.replace('"', '""') + '"'
    return part


def qualify(schema: str, name: str) -> str:
    return f"{_quote_part(schema)}.{_quote_part(name)}"


def split_qualified(text: str) -> tuple[str, str]:
    """``(schema, name)`` of a qualified name made by ``qualify`` (``ValueError`` for anything else)."""
    parts: list[str] = []
    position = 0
    while True:
        if text.startswith('"', position):
            end = position + 1
            value = []
            while True:
                close = text.find('"', end)
                if close < 0:
                    raise ValueError(f"{text!r}: unterminated quoted name")
                value.append(text[end:close])
                if text.startswith('"', close + 1):
                    value.append('"')
                    end = close + 2
                    continue
                position = close + 1
                break
            parts.append("".join(value))
        else:
            end = text.find(".", position)
            end = len(text) if end < 0 else end
            part = text[position:end]
            if not part or '"' in part:
                raise ValueError(f"{text!r}: expected schema.table (a part with '.' or '\"' double-quoted)")
            parts.append(part)
            position = end
        if position == len(text):
            break
        if text[position] != "." or len(parts) > 1:
            raise ValueError(f"{text!r}: expected schema.table (a part with '.' or '\"' double-quoted)")
        position += 1
    if len(parts) != 2:
        raise ValueError(f"{text!r}: expected schema.table (a part with '.' or '\"' double-quoted)")
    return parts[0], parts[1]


def dagster_part(text: str) -> str:
    if VALID_PART.match(text) and not HASHED_ENDING.search(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_HEX]
    prefix = INVALID_CHARACTERS.sub("_", text)[:PART_PREFIX_CHARS]
    return f"{prefix}_{digest}"


def table_slug(schema: str, name: str) -> str:
    if all(_plain_slug_part(part) for part in (schema, name)):
        return f"{schema}__{name}"
    digest = hashlib.sha256(qualify(schema, name).encode("utf-8")).hexdigest()[:HASH_HEX]
    prefix = "__".join(_squeezed(part)[:PART_PREFIX_CHARS] for part in (schema, name))
    return f"{prefix}_{digest}"


def _plain_slug_part(part: str) -> bool:
    """A part that ``table_slug`` can join as it is: the join splits back at its one ``__`` and ends unlike a hash."""
    return (
        bool(VALID_PART.match(part))
        and "__" not in part
        and not part.startswith("_")
        and not part.endswith("_")
        and not HASHED_ENDING.search(part)
    )


def _squeezed(part: str) -> str:
    return re.sub("_+", "_", INVALID_CHARACTERS.sub("_", part)).strip("_") or "t"


def lake_folder(schema: str, name: str) -> str:
    return f"{dagster_part(schema)}.{dagster_part(name)}"


def file_token(qualified_name: str) -> str:
    return quote(qualified_name, safe="")


def from_file_token(token: str) -> str:
    return unquote(token)
