"""The Delta Lake side: Spark session, lake layout, window log and window sequence, staging, mirror/changelog writes."""
