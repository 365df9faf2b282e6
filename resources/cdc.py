"""``CdcResource``: the project's configuration file, the lake, Spark, and one ``CdcSource`` per source."""

from __future__ import annotations

from functools import cached_property

from dagster import ConfigurableResource
from pyspark.sql import SparkSession

from cdc_assets.config import CdcConfig, load_config
from cdc_assets.lake.spark import spark_session
from cdc_assets.source import CdcSource
from cdc_assets.sources import open_source


class CdcResource(ConfigurableResource):
    """Reads ``config_path`` (``cdc.yaml``); credentials come from the environment it names."""

    config_path: str

    @cached_property
    def config(self) -> CdcConfig:
        return load_config(self.config_path)

    def pipeline(self, source_name: str) -> CdcSource:
        """The source's operations (a new object per call: a run resolves the captured tables once)."""
        return open_source(self.config, self.config.source(source_name))

    def spark(self) -> SparkSession:
        return spark_session(self.config.spark, self.config.lake_root)
