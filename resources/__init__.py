"""Dagster resources of the project."""

from resources.cdc import CdcResource

__all__ = ["CdcResource"]
