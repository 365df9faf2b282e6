"""The MongoDB side of the torture harness (``tools/torture.py --source mongodb``; the interface is
``tools/torture_source.py``).

Contract
--------
- **Server** (``MongoTorture``): the harness's own MongoDB test server (mongo-java-server 1.47.0, in memory, oplog
  on; the launcher of ``.jars/mongo-test-server/`` started by ``tests/integration/mongo_support.py``) on a loopback
  port of its own (``--mongo-port``, default 0: a free one), its log in ``--mongo-state`` (default
  ``<work-dir>/mongo-server``). It is stopped at the end of the command. **No server restart**: the server holds
  everything in memory, so a restart loses every collection and the oplog (a different server, not a restarted
  one); ``restart_fault`` is None and the runner schedules no restart. A real replica set would allow one; not
  built.
- **Source** (``create``): database ``torture_<seed>`` with three collections: ``mixed`` (``_id``s of every kind the
  source orders: ints, negative ints, longs, doubles, negative doubles, Decimal128, strings, strings beyond the BMP,
  ObjectIds, dates, binary of subtypes 0 and 4, subdocuments with and without arrays, and the singletons
  true, false, "", +/-Infinity, MinKey, MaxKey), ``docs`` (string ids, nested documents and arrays) and ``blobs``
  (ObjectId ids, values of a few MB: every seed holds a document with a 2-3 MB string and one with 1-2 MB of
  binary; these two are updated but never deleted, replaced or shrunk, so the source still holds them at the
  end; MB writes are rare, ``BIG_PAYLOAD`` and ``KEPT_UPDATE``, because the test server fails a change-stream reply
  over 48 MB). Documents hold values of every BSON type the source keeps apart (Int32, Int64, Double with NaN,
  Infinity and -0.0, Decimal128 with NaN and 1E+6000, dates from year 1 to 9999, binary subtypes 0 and 4,
  ObjectIds, regular expressions, timestamps, MinKey/MaxKey, null, strings with NUL and beyond the BMP) and their
  shapes vary. The harness notes the oplog's newest entry after seeding (``oracle_start``); the workload's changes
  come after it.
- **Workload**: ``--writers`` threads, every write holding the seed's one write lock: **one write at a time on the
  server**, because the test server's current position relies on it (docs/mongodb.md: a write's oplog counter value
  and its append are not one atomic step, so two concurrent writers could append out of order). The threads use
  their own clients; the lock makes them one writer, interleaving. Operations: inserts of new ids, updates with
  ``$set`` (top-level and nested ``a.b.c`` paths, whole subdocuments), ``$unset``, ``$inc`` (Int32, Int64, Double),
  ``$mul``, ``$min``/``$max``, ``$rename``, ``$currentDate``, array updates ``$push`` (with ``$each``), ``$pull``,
  ``$addToSet``, ``$pop``; replaces (another shape), deletes, re-inserts of deleted ids (of every type), upserts of
  deleted ids, ``update_many``/``delete_many``/``insert_many`` over a few ids, and in ``blobs`` now and then a
  1-3 MB value. Events at seeded points (the runner's "schema events"): every ``mixed`` document updated by one
  ``update_many``, a third of ``docs`` deleted by one ``delete_many`` and half of them inserted again, a ``blobs``
  document replaced by one of 2-4 MB. The tally counts what the server reports (``modified_count`` and the like:
  no-op updates write no oplog entry); a write whose reply was lost (a network error) is in doubt. Any other
  server error is a harness bug and stops the seed.
- **Checks** (``verify``, in the stream worker): every mirror equals its collection: per ``_id_key``
  (``bson_order.sort_key``'s hex) the ``_id`` and the document as canonical extended JSON (``bson_order``), no
  ``_cdc_unknown``, no key twice; no changelog has a ``(_cdc_position, _cdc_seq)`` twice; every changelog holds
  exactly the changes the server's own oplog (``local.oplog.rs``, read by the harness only; the pipeline never
  reads ``local``) has for that collection after ``oracle_start``, per (position, operation, ``_id``): no gap,
  nothing extra, except an update whose looked-up document was gone when the stream read it (``updateLookup``;
  the source writes no row for it), allowed only when the oplog has a delete of that ``_id`` after the update.
  The runner then checks the oplog's count against the workload's tally. ``largest_value`` is the BSON size of
  the largest document at the end.
- ``--broken-reconciliation`` (``break_settled_rule``): the worker replaces ``MongoSettledRule.unsettled``
  (``cdc_assets.sources.mongodb.watermark``) by "every event is settled" inside its own process; production code is
  unchanged.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bson
import pymongo
from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from pymongo.errors import ConnectionFailure, OperationFailure

from cdc_assets.config import (
    CdcConfig,
    MongoConnection,
    MongoOptions,
    Secret,
    SourceConfig,
    SparkConfig,
    StreamConfig,
    TableConfig,
)
from cdc_assets.sources.mongodb.bson_order import canonical_json
from cdc_assets.sources.mongodb.catalog import id_key
from cdc_assets.sources.mongodb.watermark import format_position, position_of, timestamp_of
from tests.integration.mongo_support import MongoTestServer, start_mongo_test_server
from tools.torture_source import (
    WORKER_MASTER,
    Tally,
    VerifyResult,
    WorkloadContext,
    compare_rows,
    lake_failures,
    show,
)

COLLECTIONS = ("mixed", "docs", "blobs")
OPLOG_OPS = {"i": "c", "u": "u", "d": "d"}
# The test server does not cap a reply at 16 MB as MongoDB does: a change-stream getMore returns every event left
# (with updateLookup, each with its whole document), and pymongo refuses a reply over its 48 MB message limit, so a
# backlog of MB documents beyond that fails every batch (docs/mongodb.md). MB writes are therefore rare: per write
# that draws a blobs payload, the chance of one of 1-3 MB; per blobs update, the chance it changes an MB document.
BIG_PAYLOAD = 0.01
KEPT_UPDATE = 0.02
# a lost reply: the write may or may not have happened (no restart here, but a socket can still fail)
IN_DOUBT = (ConnectionFailure,)

# ----------------------------------------------------------------------------------------------------------------
# Ids and values

TEXTS = ["", " ", "plain", "with\nnewline", 'quote " and \\ back', "nul\x00inside", "ünïcødé ✓", "😀 beyond the BMP",
         "tab\there", "null", "x" * 300]  # fmt: skip
# no null _id: on the test server one document with _id null makes every updateLookup change stream of its
# collection fail (a NullPointerException in CollectionBackedOplog.lookUpUpdateDocument; docs/mongodb.md)
SINGLETON_IDS: list[Any] = [True, False, "", float("inf"), float("-inf"), MinKey(), MaxKey()]


def _mixed_id(i: int) -> Any:
    """The ``i``-th ``_id`` of ``mixed``: 14 kinds, numbers distinct as MongoDB compares them."""
    kind, n = i % 14, i // 14
    return [
        lambda: n,
        lambda: -n - 1,
        lambda: Int64(10**12 + n),
        lambda: n + 0.5,
        lambda: -n - 0.25,
        lambda: Decimal128(f"{n}.125"),
        lambda: f"s{n:06d}",
        lambda: f"ключ{n}😀",
        lambda: ObjectId(f"{n:024x}"),
        lambda: dt.datetime(2001, 1, 1) + dt.timedelta(minutes=n),
        lambda: Binary(n.to_bytes(4, "big"), 0),
        lambda: Binary(n.to_bytes(16, "big"), 4),
        lambda: {"k": n, "t": "sub"},
        lambda: {"a": {"b": n}, "c": [n, "x"]},
    ][kind]()


def _doc_id(i: int) -> Any:
    return f"d{i:06d}" if i % 50 else f"d{i:06d} ä😀"


def _blob_id(seed: int, i: int) -> ObjectId:
    return ObjectId(f"{seed % 2**32:08x}{i:016x}")


def _millis(r: random.Random) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=r.randrange(-(10**12), 4 * 10**12))


def g_text(r: random.Random) -> str:
    return r.choice(TEXTS) if r.random() < 0.5 else f"t{r.randrange(10**6)}"


def g_value(r: random.Random) -> Any:
    """A value of any BSON type the source keeps apart."""
    return r.choice([
        lambda: r.randrange(-1000, 1000),
        lambda: Int64(r.randrange(-(2**62), 2**62)),
        lambda: r.choice([0.0, -0.0, 1.5, 0.1, 1e308, 5e-324, float("nan"), float("inf"), r.uniform(-1e6, 1e6)]),
        lambda: Decimal128(r.choice(["1.10", "-0", "NaN", "1E+6000", "12345678901234567890.12345678901234",
                                     "-Infinity"])),
        lambda: g_text(r),
        lambda: r.random() < 0.5,
        lambda: None,
        lambda: _millis(r),
        lambda: r.choice([dt.datetime(1, 1, 1), dt.datetime(9999, 12, 31, 23, 59, 59, 999000)]),
        lambda: Binary(r.randbytes(r.choice([0, 3, 40])), 0),
        lambda: Binary(r.randbytes(16), 4),
        lambda: ObjectId(r.randbytes(12)),
        lambda: Regex(r.choice(["^a.*z$", "x|y", ""]), r.choice(["", "i", "ms"])),
        lambda: Timestamp(r.randrange(1, 2**31), r.randrange(2**31)),
        lambda: r.choice([MinKey(), MaxKey()]),
        lambda: [r.randrange(10), "a", [1, [2]], {"x": None}],
        lambda: {},
        lambda: [],
    ])()  # fmt: skip


def g_sub(r: random.Random) -> dict[str, Any]:
    return {"a": {"b": g_value(r), "c": g_text(r)}, "list": [g_value(r) for _ in range(r.randrange(3))]}


def g_tags(r: random.Random) -> list[Any]:
    return [r.choice(["a", "b", "c", 3, 4.5, None]) for _ in range(r.randrange(4))]


def g_doc(r: random.Random, key: Any, payload: int = 0) -> dict[str, Any]:
    """A document of ``_id`` ``key``; its shape varies (fields absent, in another order), the typed fields that
    updates do arithmetic on (``n`` Int32, ``big`` Int64, ``ratio`` Double, ``at`` date) keep their types."""
    fields: list[tuple[str, Callable[[], Any]]] = [
        ("name", lambda: g_text(r)),
        ("n", lambda: r.randrange(-1000, 1000)),
        ("big", lambda: Int64(r.randrange(-(2**40), 2**40))),
        ("ratio", lambda: r.uniform(-1e3, 1e3)),
        ("at", lambda: _millis(r)),
        ("tags", lambda: g_tags(r)),
        ("sub", lambda: g_sub(r)),
        ("any", lambda: g_value(r)),
        ("edge", lambda: g_value(r)),
    ]
    document: dict[str, Any] = {"_id": key}
    if r.random() < 0.3:
        r.shuffle(fields)
    for name, make in fields:
        if r.random() < 0.85:
            document[name] = make()
    if payload:
        document["payload"] = payload_of(r, payload)
    return document


def payload_of(r: random.Random, size: int) -> str | Binary:
    """``size`` bytes of text (ASCII) or binary."""
    if r.random() < 0.5:
        return Binary(r.randbytes(size), 0)
    return "".join(r.choices("abcdefghijklmnopqrstuvwxyz0123456789 .,;\n", k=size))


def base_rows(scale: float) -> dict[str, int]:
    return {"mixed": max(60, int(1500 * scale)), "docs": max(40, int(900 * scale)), "blobs": max(8, int(60 * scale))}


# ----------------------------------------------------------------------------------------------------------------
# The server and the seed's database


def newest_oplog_position(client: pymongo.MongoClient) -> int:
    last = list(client.local["oplog.rs"].find({}, {"ts": 1}).sort("ts", -1).limit(1))
    return position_of(last[0]["ts"]) if last else 0


@dataclass
class Keys:
    """The live and deleted ``_id``s of one collection (changed only under the seed's write lock)."""

    live: list[Any]
    deleted: list[Any] = field(default_factory=list)
    next: int = 0
    kept: list[Any] = field(default_factory=list)  # updated, never deleted, replaced or shrunk (the MB documents)


def create_database(client: pymongo.MongoClient, database: str, seed: int, r: random.Random,
                    rows: dict[str, int]) -> tuple[dict[str, Keys], int]:  # fmt: skip
    """Seed the collections; returns their keys and the oplog's newest position after seeding."""
    client.drop_database(database)
    db = client[database]
    keys: dict[str, Keys] = {}
    mixed = [_mixed_id(i) for i in range(rows["mixed"])] + list(SINGLETON_IDS)
    docs = [_doc_id(i) for i in range(rows["docs"])]
    blobs = [_blob_id(seed, i) for i in range(rows["blobs"])]
    for name, ids in (("mixed", mixed), ("docs", docs), ("blobs", blobs)):
        documents = []
        for i, key in enumerate(ids):
            payload = r.choice([0, 100, 5000, 50_000]) if name == "blobs" else 0
            document = g_doc(r, key, payload)
            if name == "blobs" and i == 0:  # every seed holds values of a few MB
                document["payload"] = "".join(r.choices("abcdef \n", k=r.randrange(2_000_000, 3_000_000)))
            elif name == "blobs" and i == 1:
                document["payload"] = Binary(r.randbytes(r.randrange(1 << 20, 2 << 20)), 0)
            documents.append(document)
        for start in range(0, len(documents), 200):
            db[name].insert_many(documents[start : start + 200], ordered=True)
        keys[name] = (
            Keys(list(ids[2:]), next=rows[name], kept=list(ids[:2]))
            if name == "blobs"
            else Keys(list(ids), next=rows[name])
        )
    return keys, newest_oplog_position(client)


def build_config(spec: Mapping[str, Any]) -> CdcConfig:
    database = spec["db"]
    chunk_size = int(spec["chunk_size"])
    source = SourceConfig(
        name=database,
        kind="mongodb",
        connection=MongoConnection(Secret(str(spec["uri"])), 10_000, 10_000),
        slot="",
        publication="",
        startup_mode="initial",
        chunk_size=chunk_size,
        read_parallelism=2,
        tables=(TableConfig(database, "blobs", chunk_size=max(4, chunk_size // 20)),),
        include=(f"{database}.*",),
        exclude=(),
        stream=StreamConfig(max_changes=20_000),
        mongodb=MongoOptions(databases=(database,)),
    )
    return CdcConfig(lake_root=Path(spec["lake"]), spark=SparkConfig(master=WORKER_MASTER), sources=(source,))


# ----------------------------------------------------------------------------------------------------------------
# Workload


class HarnessBug(RuntimeError):
    """A write the server refused for a reason other than a lost connection: the workload's own mistake."""


class Ops:
    """The workload's writes on one client; each call holds the seed's write lock (one write at a time)."""

    def __init__(self, seed_source: MongoSeed, client: pymongo.MongoClient, r: random.Random, tally: Tally) -> None:
        self.seed = seed_source
        self.db = client[seed_source.database]
        self.r = r
        self.tally = tally

    def write(self, collection: str, expected: int, action: Callable[[], int]) -> int:
        """Run ``action`` (returns the changes the server reports) and tally them; a lost reply counts
        ``expected`` changes in doubt; any other server error is a harness bug."""
        try:
            changes = action()
        except IN_DOUBT:
            self.tally.add(Counter({collection: expected}), certain=False)
            return -1
        except OperationFailure as error:
            raise HarnessBug(f"{collection}: {error}") from error
        self.tally.add(Counter({collection: changes}), certain=True)
        return changes

    # -- single operations ------------------------------------------------------------------------------------
    def new_key(self, name: str) -> Any:
        """An ``_id`` never used in the collection (seeded ids are ``0 .. rows - 1`` and the singletons)."""
        keys = self.seed.keys[name]
        index, keys.next = keys.next, keys.next + 1
        if name == "mixed":
            return _mixed_id(index)  # the kinds in turn
        if name == "docs":
            return _doc_id(index)
        return _blob_id(self.seed.seed, index)

    def insert(self, name: str) -> None:
        keys = self.seed.keys[name]
        key = self.new_key(name)
        document = g_doc(self.r, key, self.payload(name))
        if self.write(name, 1, lambda: int(self.db[name].insert_one(document).acknowledged)) != 0:
            keys.live.append(key)

    def payload(self, name: str) -> int:
        if name != "blobs":
            return 0
        if self.r.random() < BIG_PAYLOAD:
            return self.r.randrange(1_000_000, 3_000_000)  # now and then a value of a few MB
        return self.r.choice([0, 100, 5000, 50_000])

    def update(self, name: str) -> None:
        keys = self.seed.keys[name]
        if not keys.live:
            return self.insert(name)
        kept = keys.kept and self.r.random() < KEPT_UPDATE
        key = self.r.choice(keys.kept if kept else keys.live)
        r = self.r
        if key in keys.kept:  # a document of a few MB stays one: small changes, each event carries all of it
            update = r.choice([{"$inc": {"n": 1}}, {"$set": {"name": g_text(r)}}, {"$push": {"tags": "k"}}])
            self.write(name, 1, lambda: self.db[name].update_one({"_id": key}, update).modified_count)
            return
        update = r.choice([
            lambda: {"$set": {"name": g_text(r), f"f{r.randrange(4)}": g_value(r)}},
            lambda: {"$set": {"sub.a.b": g_value(r), "sub.deep.er": {"x": g_value(r)}}},
            lambda: {"$set": {"sub": g_sub(r)}},
            lambda: {"$unset": {r.choice(["name", "any", "tags", "sub", "edge", "f0", "payload"]): ""}},
            lambda: {"$inc": {"n": r.randrange(-5, 6), "big": Int64(r.randrange(1, 99)), "ratio": 0.25}},
            lambda: {"$mul": {"n": -1}},
            lambda: {r.choice(["$min", "$max"]): {"at": _millis(r), "n": r.randrange(-1000, 1000)}},
            lambda: {"$rename": r.choice([{"name": "label"}, {"label": "name"}])},
            lambda: {"$currentDate": {"touched": True}},
            lambda: {"$push": {"tags": r.choice(["a", "b", 3, None])}},
            lambda: {"$push": {"tags": {"$each": g_tags(r)}}},
            lambda: {"$pull": {"tags": r.choice(["a", "b", 3])}},
            lambda: {"$addToSet": {"tags": r.choice(["a", "c", 4.5])}},
            lambda: {"$pop": {"tags": r.choice([1, -1])}},
        ])()  # fmt: skip
        if name == "blobs" and r.random() < 0.15:
            update = {"$set": {"payload": payload_of(r, self.payload(name) or 10)}}
        self.write(name, 1, lambda: self.db[name].update_one({"_id": key}, update).modified_count)

    def replace(self, name: str) -> None:
        keys = self.seed.keys[name]
        if not keys.live:
            return self.insert(name)
        key = self.r.choice(keys.live)
        document = g_doc(self.r, key, self.payload(name))
        document.pop("_id")
        document["replaced"] = self.r.randrange(10**6)
        self.write(name, 1, lambda: self.db[name].replace_one({"_id": key}, document).modified_count)

    def delete(self, name: str) -> None:
        keys = self.seed.keys[name]
        if not keys.live:
            return
        key = keys.live.pop(self.r.randrange(len(keys.live)))
        keys.deleted.append(key)
        self.write(name, 1, lambda: self.db[name].delete_one({"_id": key}).deleted_count)

    def reinsert(self, name: str, upsert: bool) -> None:
        """A deleted id back: inserted again (another document), or by an upsert."""
        keys = self.seed.keys[name]
        if not keys.deleted:
            return self.insert(name)
        key = keys.deleted.pop(self.r.randrange(len(keys.deleted)))
        keys.live.append(key)
        document = g_doc(self.r, key, self.payload(name))
        if upsert:
            document.pop("_id")

            def upserted() -> int:
                result = self.db[name].update_one({"_id": key}, {"$set": document}, upsert=True)
                return 1 if result.upserted_id is not None else result.modified_count

            self.write(name, 1, upserted)
        else:
            self.write(name, 1, lambda: int(self.db[name].insert_one(document).acknowledged))

    # -- several documents in one command ---------------------------------------------------------------------
    def update_many(self, name: str) -> None:
        keys = self.seed.keys[name]
        chosen = self.r.sample(keys.live, min(len(keys.live), self.r.randint(2, 10)))
        update = {"$inc": {"n": 1}, "$set": {"many": self.r.randrange(1000)}}
        self.write(name, len(chosen),
                   lambda: self.db[name].update_many({"_id": {"$in": chosen}}, update).modified_count)  # fmt: skip

    def delete_many(self, name: str, count: int) -> None:
        keys = self.seed.keys[name]
        chosen = self.r.sample(keys.live, min(len(keys.live), count))
        for key in chosen:
            keys.live.remove(key)
        keys.deleted.extend(chosen)
        self.write(name, len(chosen), lambda: self.db[name].delete_many({"_id": {"$in": chosen}}).deleted_count)

    def insert_many(self, name: str, keys_back: list[Any] | None = None) -> None:
        keys = self.seed.keys[name]
        if keys_back is None:
            keys_back = [self.new_key(name) for _ in range(self.r.randint(2, 5))]
        else:
            for key in keys_back:
                keys.deleted.remove(key)
        if not keys_back:
            return
        documents = [g_doc(self.r, key, self.payload(name)) for key in keys_back]
        keys.live.extend(keys_back)
        self.write(name, len(documents),
                   lambda: len(self.db[name].insert_many(documents).inserted_ids))  # fmt: skip

    def random_op(self) -> None:
        name = self.r.choices(COLLECTIONS, weights=[5, 4, 1])[0]
        draw = self.r.random()
        if draw < 0.12:
            self.insert(name)
        elif draw < 0.55:
            self.update(name)
        elif draw < 0.65:
            self.replace(name)
        elif draw < 0.78:
            self.delete(name)
        elif draw < 0.88:
            self.reinsert(name, upsert=False)
        elif draw < 0.92:
            self.reinsert(name, upsert=True)
        elif draw < 0.95:
            self.update_many(name)
        elif draw < 0.97:
            self.delete_many(name, self.r.randint(2, 5))
        else:
            self.insert_many(name)


class Writer(threading.Thread):
    """One writer thread: random operations at ``rate`` per second, each under the seed's write lock."""

    def __init__(self, name: str, seed: int, rate: float, ctx: WorkloadContext, seed_source: MongoSeed) -> None:
        super().__init__(name=name, daemon=True)
        self.ctx = ctx
        self.seed_source = seed_source
        self.client: pymongo.MongoClient = pymongo.MongoClient(seed_source.uri)
        self.ops = Ops(seed_source, self.client, random.Random(f"{seed}:{name}"), ctx.tally)
        self.interval = 1.0 / max(rate, 0.1)

    def run(self) -> None:
        try:
            next_at = time.monotonic()
            while not self.ctx.stop.is_set():
                with self.seed_source.write_lock:
                    self.ops.random_op()
                next_at += self.interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        except BaseException:
            self.ctx.fatal(f"writer {self.name}: {traceback.format_exc(limit=3)}")
        finally:
            self.client.close()


# ----------------------------------------------------------------------------------------------------------------
# Verification (runs in the stream worker's process, which has a Spark session)


def oplog_changes(client: pymongo.MongoClient, database: str, start: int) -> dict[str, Counter[tuple[int, str, str]]]:
    """Per collection (qualified name), the oplog's changes after ``start`` as (position, op, ``_id_key``)."""
    result: dict[str, Counter[tuple[int, str, str]]] = {}
    namespaces = [f"{database}.{name}" for name in COLLECTIONS]
    query = {"ts": {"$gt": timestamp_of(start)}, "ns": {"$in": namespaces}}
    projection = {"ts": 1, "op": 1, "ns": 1, "o._id": 1, "o2._id": 1}
    for entry in client.local["oplog.rs"].find(query, projection):
        op = OPLOG_OPS.get(entry["op"])
        if op is None:
            continue
        key = (entry.get("o2") if op == "u" else entry.get("o")) or {}
        if "_id" not in key:
            raise AssertionError(f"oplog entry without _id: {show(entry)}")
        position = position_of(entry["ts"])
        result.setdefault(entry["ns"], Counter())[(position, op, id_key(key["_id"]))] += 1
    return result


def compare_log(name: str, log: Counter[tuple[int, str, str]], oplog: Counter[tuple[int, str, str]]) -> tuple[
    str | None, int
]:  # fmt: skip
    """The first difference between a changelog and the oplog (see the module docstring), and the number of
    updates whose document was gone when the stream looked it up."""
    deletes: dict[str, list[int]] = {}
    for position, op, key in oplog:
        if op == "d":
            deletes.setdefault(key, []).append(position)
    gone = 0
    for change in sorted(set(log) | set(oplog)):
        got, want = log[change], oplog[change]
        if got == want:
            continue
        position, op, key = change
        if got == 0 and want == 1 and op == "u" and any(p > position for p in deletes.get(key, [])):
            gone += 1
            continue
        kind = "gap" if got < want else "extra"
        return (
            f"changelog {name}: cluster time {format_position(position)} op {op} _id_key {key[:40]}: the changelog "
            f"has {got} changes, the oplog {want} ({kind}; {sum(log.values())} vs {sum(oplog.values())} in total)"
        ), gone
    return None, gone


def verify(spark: Any, spec: Mapping[str, Any], oracle_start: int) -> VerifyResult:
    """Mirrors against collections, changelogs against duplicates and against the oplog (module docstring)."""
    from pyspark.sql import functions as F

    from cdc_assets.sources import open_source

    config = build_config(spec)
    pipeline = open_source(config, config.sources[0])
    tables = pipeline.prepare()
    failures: list[str] = []
    total = largest = 0
    decoded: dict[str, int] = {}
    with pymongo.MongoClient(str(spec["uri"])) as client:
        oplog = oplog_changes(client, str(spec["db"]), oracle_start)
        for name, table in sorted(tables.items()):
            paths = pipeline.lake.table(name)
            frame = spark.read.format("delta").load(paths.mirror)
            mirror: dict[tuple, tuple] = {}
            for row in frame.select("_id_key", "_id", "document").toArrow().to_pylist():
                key = (row["_id_key"],)
                if key in mirror:
                    failures.append(f"table {name} key {key}: two mirror rows")
                mirror[key] = (row["_id"], row["document"])
            source: dict[tuple, tuple] = {}
            database, collection = table.namespace
            for document in client[database][collection].find():
                largest = max(largest, len(bson.encode(document)))
                source[(id_key(document["_id"]),)] = (canonical_json(document["_id"]), canonical_json(document))
            difference = compare_rows(name, ["_id", "document"], mirror, source)
            if difference is not None:
                failures.append(difference)
            problems, changelog = lake_failures(spark, name, frame, paths.changelog, "_cdc_position", format_position)
            failures += problems
            log: Counter[tuple[int, str, str]] = Counter()
            if changelog is not None:
                keyed = changelog.select(
                    "_cdc_position", "_cdc_op", F.coalesce("after._id_key", "before._id_key").alias("key")
                )
                for r in keyed.groupBy("_cdc_position", "_cdc_op", "key").count().collect():
                    log[(r["_cdc_position"], r["_cdc_op"], r["key"])] = r["count"]
            expected = oplog.get(name, Counter())
            total += sum(log.values())
            decoded[name] = sum(expected.values())
            difference, _ = compare_log(name, log, expected)
            if difference is not None:
                failures.append(difference)
    return {"failures": failures, "changes": total, "decoded": decoded, "largest_value": largest}


# ----------------------------------------------------------------------------------------------------------------
# The source as the runner sees it


@dataclass
class MongoSeed:
    """One seed's database (``SeedSource``)."""

    uri: str
    database: str
    seed: int
    spec: dict[str, Any]
    keys: dict[str, Keys]
    oracle_start: int
    write_lock: threading.Lock = field(default_factory=threading.Lock)  # one write at a time on the server

    @property
    def name(self) -> str:
        return f"database {self.database} (in the harness's test server: gone when the command ends)"

    def workload(self, ctx: WorkloadContext, seed: int, duration: float, rate: float, writers: int
                 ) -> list[threading.Thread]:  # fmt: skip
        count = max(1, writers)
        return [Writer(f"writer{i}", seed, rate / count, ctx, self) for i in range(count)]

    def schema_events(self, r: random.Random) -> list[tuple[float, str]]:
        return [(r.uniform(0.2, 0.4), "update_all"), (r.uniform(0.3, 0.7), "delete_third"),
                (r.uniform(0.4, 0.8), "big_replace")]  # fmt: skip

    def run_event(self, event: str, ctx: WorkloadContext, r: random.Random) -> None:
        with pymongo.MongoClient(self.uri) as client, self.write_lock:
            ops = Ops(self, client, r, ctx.tally)
            if event == "update_all":  # every document of mixed in one command
                ops.write("mixed", len(self.keys["mixed"].live),
                          lambda: ops.db["mixed"].update_many({}, {"$inc": {"gen": 1}}).modified_count)  # fmt: skip
            elif event == "delete_third":  # a third of docs in one command, then half of them back in one
                before = list(self.keys["docs"].deleted)
                ops.delete_many("docs", len(self.keys["docs"].live) // 3)
                gone = [k for k in self.keys["docs"].deleted if k not in before]
                ops.insert_many("docs", gone[: len(gone) // 2])
            elif event == "big_replace":
                keys = self.keys["blobs"]
                if keys.live:
                    key = r.choice(keys.live)
                    document = g_doc(r, key, r.randrange(2_000_000, 4_000_000))
                    document.pop("_id")
                    ops.write("blobs", 1, lambda: ops.db["blobs"].replace_one({"_id": key}, document).modified_count)
            else:
                raise ValueError(f"unknown event {event!r}")

    def verify_args(self) -> dict[str, Any]:
        return {"oracle_start": self.oracle_start}

    def drop(self) -> None:
        with pymongo.MongoClient(self.uri) as client:
            client.drop_database(self.database)


class MongoTorture:
    """The harness's MongoDB test server (``TortureSource``)."""

    kind = "mongodb"
    restart_fault: str | None = None  # in memory: a restart loses everything (module docstring)

    def __init__(self, port: int, state: Path) -> None:
        self.port = port
        self.state = state
        self.server: MongoTestServer | None = None

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--mongo-port", type=int, default=0, help="the test server's loopback port (0: a free one)")
        group.add_argument("--mongo-state", type=Path, help="the test server's log folder (<work-dir>/mongo-server)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MongoTorture:
        state = args.mongo_state if args.mongo_state is not None else args.work_dir / "mongo-server"
        return cls(args.mongo_port, state.resolve())

    @property
    def uri(self) -> str:
        if self.server is None:
            raise RuntimeError("the MongoDB test server is not running")
        return self.server.uri

    def running(self) -> bool:
        return self.server is not None and self.server.process.poll() is None

    def start(self) -> None:
        if not self.running():
            self.server = start_mongo_test_server(self.state, port=self.port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restart(self) -> None:
        raise NotImplementedError("the MongoDB test server keeps everything in memory: a restart would lose it all")

    def create(self, seed: int, r: random.Random, scale: float, lake: Path, chunk_size: int) -> MongoSeed:
        database = f"torture_{seed}"
        with pymongo.MongoClient(self.uri) as client:
            keys, oracle_start = create_database(client, database, seed, r, base_rows(scale))
        spec = {"db": database, "uri": self.uri, "lake": str(lake), "chunk_size": chunk_size}
        return MongoSeed(self.uri, database, seed, spec, keys, oracle_start)

    @staticmethod
    def build_config(spec: Mapping[str, Any]) -> CdcConfig:
        return build_config(spec)

    @staticmethod
    def offset_position(offset: Mapping[str, object]) -> int:
        return (int(str(offset["sec"])) << 32) | int(str(offset["ord"]))

    @staticmethod
    def verify(spark: Any, spec: Mapping[str, Any], args: Mapping[str, Any]) -> VerifyResult:
        return verify(spark, spec, int(args["oracle_start"]))

    @staticmethod
    def break_settled_rule() -> None:
        from pyspark.sql import functions as F

        from cdc_assets.sources.mongodb.watermark import MongoSettledRule

        def every_event_settled(self: MongoSettledRule) -> Any:
            return F.lit(False)

        MongoSettledRule.unsettled = every_event_settled  # type: ignore[method-assign]
