"""The torture harness's split between the runner and a source's side (``tools/torture_source.py``).

- the runner (``tools/torture.py``) loads no database driver and no source's module until a source kind is asked
  for, so a second source plugs in beside PostgreSQL without touching it; an unknown kind is refused by name;
- ``PostgresTorture`` provides every operation of the ``TortureSource`` interface, its command-line options too;
- ``compare_rows`` reports the first differing key in key order with only the differing columns, treats NaN as
  equal to NaN, and names a row that exists on one side only;
- ``Tally`` keeps committed changes apart from commits whose outcome is unknown.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections import Counter

import pytest

from tests.tools.torture_support import ROOT
from tools.torture_source import SeedSource, Tally, TortureSource, compare_rows


@pytest.mark.parametrize(
    ("kind", "modules"),
    [("postgres", "['psycopg', 'tools.torture_postgres']"), ("mongodb", "['pymongo', 'tools.torture_mongodb']")],
)
def test_runner_loads_no_source_module_until_a_kind_is_asked_for(kind: str, modules: str) -> None:
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tools.torture as t; "
        "names = ('psycopg', 'pymongo', 'pyspark', 'tools.torture_postgres', 'tools.torture_mongodb'); "
        "loaded = lambda: sorted(m for m in names if m in sys.modules); "
        "print(loaded()); t.source_kind(sys.argv[2]); print(loaded())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT), kind], capture_output=True, text=True, check=True
    )  # fmt: skip
    before, after = result.stdout.splitlines()
    assert before == "[]"
    assert after == modules  # the other kind's driver stays unloaded


def test_unknown_source_kind_is_refused_by_name() -> None:
    from tools.torture import source_kind

    with pytest.raises(ValueError, match=r"source kind 'oracle' has no torture side; allowed: postgres, mongodb"):
        source_kind("oracle")


def _operations(protocol: type) -> set[str]:
    return {n for n in dir(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def _provides_the_whole_interface(torture: type, seed: type) -> None:
    for implementation, protocol in ((torture, TortureSource), (seed, SeedSource)):
        missing = {n for n in _operations(protocol) if not hasattr(implementation, n)}
        missing -= set(getattr(implementation, "__dataclass_fields__", {}))  # instance fields
        assert not missing, f"{implementation.__name__} lacks {sorted(missing)}"
    for name in ("add_arguments", "build_config", "offset_position", "verify", "break_settled_rule"):  # on the class
        assert isinstance(inspect.getattr_static(torture, name), staticmethod), name
    assert isinstance(inspect.getattr_static(torture, "from_args"), classmethod)


def test_postgres_side_provides_the_whole_interface() -> None:
    from tools.torture_postgres import PostgresSeed, PostgresTorture

    _provides_the_whole_interface(PostgresTorture, PostgresSeed)
    assert PostgresTorture.offset_position({"lsn": "0/16B3748"}) == 0x16B3748
    assert PostgresTorture.restart_fault == "pg-restart"


def test_mongodb_side_provides_the_whole_interface() -> None:
    """The MongoDB side too; its position is the cluster time's (sec << 32) | ord, and it has no restart fault (the
    test server is in memory: a restart would lose every collection)."""
    from tools.torture_mongodb import MongoSeed, MongoTorture

    _provides_the_whole_interface(MongoTorture, MongoSeed)
    assert MongoTorture.offset_position({"sec": 1795735389, "ord": 501}) == (1795735389 << 32) | 501
    assert MongoTorture.restart_fault is None


def test_the_source_kind_brings_its_own_options(tmp_path) -> None:
    """The runner knows no server option: ``--pg-port`` and ``--pg-state`` are the PostgreSQL side's
    (``add_arguments``), and the server under torture is built from them (``from_args``)."""
    from tools.torture import parse_args, source_kind

    args = parse_args(["--seeds", "3", "--pg-port", "54399", "--pg-state", str(tmp_path / "pg")])
    server = source_kind(args.source).from_args(args)
    assert (server.cluster.port, server.cluster.state) == (54399, tmp_path / "pg")
    assert parse_args(["--seeds", "3"]).pg_port == 54339
    runner_source = (ROOT / "tools" / "torture.py").read_text()
    assert "--pg-" not in runner_source and "pg_port" not in runner_source
    args = parse_args(["--source", "mongodb", "--mongo-port", "54398", "--work-dir", str(tmp_path / "w")])
    server = source_kind(args.source).from_args(args)
    assert (server.port, server.state) == (54398, tmp_path / "w" / "mongo-server")
    assert parse_args(["--source", "mongodb"]).mongo_port == 0  # a free port: never the demo's or the suite's
    assert "--mongo-" not in runner_source and "mongo_port" not in runner_source
    with pytest.raises(SystemExit):
        parse_args(["--mongo-port", "1"])  # a PostgreSQL run has no MongoDB options


def test_the_workload_lasts_its_duration_every_first_snapshot_and_its_minimum_of_transactions() -> None:
    """``--min-transactions``: the amount of work a seed does does not depend on how fast its chunks were snapshotted
    (CI's run of the short form was done after 214 transactions, a slower machine's after 810)."""
    from tools.torture import parse_args, workload_done

    assert parse_args(["--seeds", "1"]).min_transactions == 0
    assert parse_args(["--seeds", "1", "--min-transactions", "250"]).min_transactions == 250
    assert workload_done(20.0, 20.0, 0, 250, 250)
    assert not workload_done(19.9, 20.0, 0, 250, 250)  # the duration
    assert not workload_done(60.0, 20.0, 1, 900, 250)  # an initial snapshot run left
    assert not workload_done(60.0, 20.0, 0, 249, 250)  # too few transactions
    assert workload_done(20.0, 20.0, 0, 0, 0)


def test_compare_rows_names_the_first_differing_key_and_columns() -> None:
    columns = ["id", "name", "ratio"]
    source = {(1,): (1, "a", float("nan")), (2,): (2, "b", 1.5), (3,): (3, "c", 2.0)}
    assert compare_rows("public.t", columns, dict(source), source) is None
    mirror = {(1,): (1, "a", float("nan")), (2,): (2, "b", 1.25), (3,): (3, "x", 2.0)}
    assert compare_rows("public.t", columns, mirror, source) == (
        "table public.t key (2): mirror={ratio: 1.25} source={ratio: 1.5}"
    )
    del mirror[(2,)]
    assert compare_rows("public.t", columns, mirror, source) == (
        "table public.t key (2): mirror=None source=(2, 'b', 1.5)"
    )


def test_tally_keeps_commits_in_doubt_apart() -> None:
    tally = Tally()
    tally.add(Counter({"items": 2}), certain=True)
    tally.add(Counter({"items": 1, "docs": 4}), certain=False)
    assert (tally.committed, tally.in_doubt, tally.transactions) == (
        Counter({"items": 2}),
        Counter({"items": 1, "docs": 4}),
        1,
    )
