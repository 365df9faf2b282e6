"""Read-only change data capture from PostgreSQL into Delta Lake, orchestrated by Dagster."""
