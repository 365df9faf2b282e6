"""The CDC engine's pure decisions, no Spark and no Dagster: chunk plans, open and closable windows, batch bounds,
fault points, names, key chains."""
