"""Source dialects: one package per database kind (``postgres``, ``mongodb``), each supplying what differs between
databases.

Contract: ``open_source(config, source)`` returns the ``CdcSource`` (``cdc_assets.source``) of ``source.kind``,
importing that kind's package only then; a kind without one raises ``UnsupportedSourceError`` naming the source,
the kind and the allowed kinds. This registry is the only place that names the source packages: the generic
packages (``cdc_assets.engine``, ``cdc_assets.lake``) import none of them (``tests/test_package_layout.py``).
"""

from __future__ import annotations

from cdc_assets.config import SOURCE_KINDS, CdcConfig, SourceConfig
from cdc_assets.source import CdcSource


class UnsupportedSourceError(ValueError):
    """A source kind without an implementation."""


def open_source(config: CdcConfig, source: SourceConfig) -> CdcSource:
    """The ``CdcSource`` of ``source`` (by ``source.kind``)."""
    if source.kind == "postgres":
        from cdc_assets.sources.postgres.pipeline import PostgresPipeline

        return PostgresPipeline(config, source)
    if source.kind == "mongodb":
        from cdc_assets.lake.layout import SourceLake
        from cdc_assets.pipeline import CdcPipeline
        from cdc_assets.sources.mongodb.dialect import MongoDialect

        return CdcPipeline(config, source, MongoDialect(source, SourceLake(config.lake_root, source.name).control))
    raise UnsupportedSourceError(
        f"source {source.name!r}: kind {source.kind!r} has no implementation; allowed: {', '.join(SOURCE_KINDS)}"
    )
