"""Read-only change data capture from PostgreSQL (and, in progress, MongoDB) into Delta Lake, orchestrated by Dagster."""
