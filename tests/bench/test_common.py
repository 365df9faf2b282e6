"""The benchmarks' shared pieces (``bench/common.py``): a command started without the project's cluster stops with a
message naming where it looked and how to start one, not psycopg's bare "No such file or directory"."""

from __future__ import annotations

import pytest

from bench.common import ClusterNotRunning, admin_connect


def test_a_bench_without_a_running_cluster_says_how_to_start_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_PG_SOCKET", str(tmp_path))
    monkeypatch.setenv("CDC_PG_PORT", "54398")
    with pytest.raises(ClusterNotRunning) as stopped:
        admin_connect("postgres")
    message = str(stopped.value)
    assert str(tmp_path / ".s.PGSQL.54398") in message
    assert "scripts/pg.sh start" in message
