"""Read-only change data capture from PostgreSQL (MongoDB in progress) into Delta Lake, orchestrated by Dagster."""
