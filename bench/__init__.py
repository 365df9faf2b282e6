"""Benchmarks of issue #4: one command per benchmark (``python -m bench.<name> --help``).

- ``bench.snapshot``: full snapshot of a wide table: ``psql \\copy`` vs dlt (connectorx -> Delta) vs ours.
- ``bench.stream``: stream batches' changes/s vs the server's pgoutput decode rate of the same WAL.
- ``bench.lag``: the stream's lag (bytes, seconds) while a full snapshot of a big table runs.
- ``bench.freshness``: commit-to-mirror latency with the Dagster daemon and the streaming sensor.

Results measured on the development machine: ``bench/RESULTS.md``; plots and JSON records: ``bench/out/``.
"""
