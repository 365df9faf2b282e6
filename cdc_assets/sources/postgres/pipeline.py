"""``PostgresPipeline``: the generic pipeline (``cdc_assets.pipeline.CdcPipeline``) over ``PostgresDialect``.

Contract: everything a PostgreSQL source does differently is in ``cdc_assets.sources.postgres.dialect``; this class
only checks the source's kind and keeps ``connect()`` for callers that inspect the source (tests, the torture
harness).
"""

from __future__ import annotations

import psycopg

from cdc_assets.config import CdcConfig, SourceConfig
from cdc_assets.pipeline import CdcPipeline, StreamBatchError
from cdc_assets.source import SourceError
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.dialect import SETTLED_RULE, PostgresDialect

__all__ = ["SETTLED_RULE", "PostgresPipeline", "StreamBatchError"]


class PostgresPipeline(CdcPipeline[CapturedTable]):
    dialect: PostgresDialect

    def __init__(self, config: CdcConfig, source: SourceConfig) -> None:
        if source.kind != "postgres":
            raise SourceError(f"source {source.name!r}: kind {source.kind!r} is not handled by PostgresPipeline")
        super().__init__(config, source, PostgresDialect(source))

    def connect(self) -> psycopg.Connection:
        return self.dialect.connect()
