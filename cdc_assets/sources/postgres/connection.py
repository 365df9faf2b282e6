"""Connections to the source database, with canonical session settings and credential-free error messages.

Contract: ``connect(config)`` returns an autocommit ``psycopg.Connection`` with ``SESSION_SETTINGS`` applied (so
text output is identical on the snapshot and the stream path) or raises ``SourceError`` with a message that names
the source and server but never the password.
"""

from __future__ import annotations

import psycopg

from cdc_assets.config import PostgresConnection
from cdc_assets.source import SourceError
from cdc_assets.sources.postgres.pg_values import apply_session_settings

__all__ = ["SourceError", "connect"]


def connect(config: PostgresConnection, source_name: str, autocommit: bool = True) -> psycopg.Connection:
    try:
        conn = psycopg.connect(**config.kwargs(), autocommit=autocommit)
    except psycopg.OperationalError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if config.password is not None:
            reason = reason.replace(config.password.value, "***")
        raise SourceError(f"source {source_name!r}: cannot connect to {config.describe()}: {reason}") from None
    apply_session_settings(conn)
    if not autocommit:
        conn.commit()
    return conn
