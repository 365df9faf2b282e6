"""The MongoDB side of the torture harness (``tools/torture_mongodb.py``), without the runner or Spark.

- ``compare_log`` (the changelog against the oplog, per position, operation and ``_id``) passes equal logs, allows a
  missing update only when the oplog deletes that ``_id`` after it (``updateLookup`` found no document), and names
  any other gap or extra change;
- on the MongoDB test server, the workload's own tally of changes equals what the oplog holds after the seed's start
  (the oracle the runner checks the changelog count against), the seeded database holds every ``_id`` kind and a
  document of at least 1 MB, and the write lock is held for every write.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from pathlib import Path

import bson
import pymongo

from cdc_assets.sources.mongodb.bson_order import type_bracket
from tools.torture_mongodb import MongoSeed, Ops, compare_log, create_database, oplog_changes
from tools.torture_source import Tally, WorkloadContext


def test_compare_log_allows_only_updates_of_documents_deleted_later() -> None:
    oplog = Counter({(10, "c", "k1"): 1, (11, "u", "k1"): 1, (12, "u", "k2"): 1, (13, "d", "k1"): 1})
    assert compare_log("db.items", Counter(oplog), oplog) == (None, 0)
    # k1's update had no document to look up: deleted at 13, after it
    log = Counter(oplog)
    del log[(11, "u", "k1")]
    assert compare_log("db.items", log, oplog) == (None, 1)
    # k2's update missing, and k2 never deleted: a gap
    log = Counter(oplog)
    del log[(12, "u", "k2")]
    difference, _ = compare_log("db.items", log, oplog)
    assert difference is not None and "op u _id_key k2" in difference and "(gap;" in difference
    # a delete is never skipped
    log = Counter(oplog)
    del log[(13, "d", "k1")]
    difference, _ = compare_log("db.items", log, oplog)
    assert difference is not None and "op d _id_key k1" in difference
    # a change the oplog does not have, or one twice
    for extra in ((14, "c", "k3"), (10, "c", "k1")):
        log = Counter(oplog)
        log[extra] += 1
        difference, _ = compare_log("db.items", log, oplog)
        assert difference is not None and "(extra;" in difference, extra


class CountingLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.held += 1

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_the_workloads_tally_equals_the_oplog(mongo_server: str, tmp_path: Path) -> None:
    database = "torture_test_tally"
    with pymongo.MongoClient(mongo_server) as client:
        rows = {"mixed": 60, "docs": 40, "blobs": 8}
        keys, start = create_database(client, database, 7, random.Random(7), rows)
        try:
            brackets = {type_bracket(k).name for k in keys["mixed"].live}
            assert brackets == {"MIN_KEY", "NUMBER", "STRING", "OBJECT", "BINARY", "OBJECT_ID", "BOOLEAN", "DATE",
                                "MAX_KEY"}  # fmt: skip
            assert max(len(bson.encode(d)) for d in client[database]["blobs"].find()) >= 1 << 20
            seed = MongoSeed(mongo_server, database, 7, {}, keys, start)
            tally = Tally()
            ops = Ops(seed, client, random.Random(3), tally)
            for _ in range(400):
                ops.random_op()
            for event in ("update_all", "delete_third", "big_replace"):
                lock = CountingLock()
                seed.write_lock = lock  # type: ignore[assignment]
                seed.run_event(event, WorkloadContext(tally), random.Random(event))
                assert lock.held == 1
            oplog = oplog_changes(client, database, start)
            counted = {name.split(".", 1)[1]: sum(changes.values()) for name, changes in oplog.items()}
            assert not tally.in_doubt
            assert counted == {name: count for name, count in tally.committed.items() if count}, (counted, tally)
            assert counted["mixed"] > 60  # update_all alone changed every live document of mixed
            ops_seen = {op for changes in oplog.values() for _, op, _ in changes}
            assert ops_seen == {"c", "u", "d"}
            live = {name: client[database][name].count_documents({}) for name in rows}
            assert live == {name: len(keys[name].live) + len(keys[name].kept) for name in rows}  # known ids
        finally:
            client.drop_database(database)
