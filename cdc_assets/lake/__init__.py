"""The Delta Lake side: Spark session, lake layout, chunk window log, mirror/changelog writes, the source pipeline."""
