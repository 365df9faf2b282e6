"""The CDC engine: pure-Python modules with no Dagster import (chunking, watermarks, decoding, offsets)."""
