"""Sensors: streaming micro-batches and chunk planning per source."""
