"""Demo MongoDB source: ``setup`` fills the database ``shop`` of the demo's test server; ``workload`` writes to it.

    python tools/demo_mongo.py setup                # two collections, kept when they exist already
    python tools/demo_mongo.py workload [OPS_PER_S] # one writer until interrupted

``shop.products``: 20,000 documents with int ``_id``s, nested fields, Decimal128 prices, dates and arrays.
``shop.sessions``: 3,000 documents whose ``_id``s are ObjectIds, strings, ints, longs, doubles and subdocuments,
and a few large ones (1, 4 and 12 MB). The workload is one writer (the test server's change streams assume one
writer at a time, docs/mongodb.md): inserts, ``$set`` (also nested), ``$unset``, ``$inc``, ``$push``/``$pull``,
replaces, deletes and re-inserts of deleted ``_id``s, and now and then a new version of a large document.

Environment: CDC_MONGODB_URI (the demo's server, e.g. ``mongodb://127.0.0.1:54337/?directConnection=true``).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pymongo
from bson import Decimal128, Int64, ObjectId

DATABASE = "shop"
PRODUCTS = 20_000
SESSIONS = 3_000
LARGE_SIZES = {"large-1mb": 1_000_000, "large-4mb": 4_000_000, "large-12mb": 12_000_000}
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def connect() -> pymongo.MongoClient:
    return pymongo.MongoClient(os.environ["CDC_MONGODB_URI"], serverSelectionTimeoutMS=10_000)


def product(number: int, rng: random.Random) -> dict[str, Any]:
    return {
        "_id": number,
        "sku": f"SKU-{number:06d}",
        "name": f"Product {number}",
        "price": Decimal128(Decimal(rng.randint(99, 99_999)) / 100),
        "stock": rng.randint(0, 500),
        "tags": [f"t{number % 7}", f"t{number % 11}"],
        "dimensions": {"w": rng.random() * 100, "h": rng.random() * 100, "unit": "cm"},
        "added": EPOCH + timedelta(minutes=number),
    }


def session_id(number: int) -> Any:
    """Mixed ``_id`` types, in BSON order across the collection: numbers, strings, subdocuments, ObjectIds."""
    kind = number % 6
    if kind == 0:
        return ObjectId(f"{number:024x}")
    if kind == 1:
        return f"session-{number}"
    if kind == 2:
        return number
    if kind == 3:
        return Int64(10**12 + number)
    if kind == 4:
        return number + 0.5
    return {"user": number % 97, "n": number}


def session(number: int, rng: random.Random) -> dict[str, Any]:
    return {
        "_id": session_id(number),
        "user": f"user{number % 97}",
        "started": EPOCH + timedelta(seconds=number * 17),
        "pages": [f"/p/{rng.randint(1, PRODUCTS)}" for _ in range(rng.randint(0, 5))],
        "cart": {"items": rng.randint(0, 9), "total": Decimal128(str(rng.randint(0, 50_000) / 100))},
    }


def large(name: str, version: int) -> dict[str, Any]:
    size = LARGE_SIZES[name]
    return {"_id": name, "version": version, "payload": (f"v{version}-" * (size // 4 + 1))[:size]}


def setup() -> None:
    client = connect()
    db = client[DATABASE]
    if db.products.estimated_document_count() and db.sessions.estimated_document_count():
        print("demo MongoDB database shop exists; keeping it")
        return
    db.products.drop()
    db.sessions.drop()
    rng = random.Random(11)
    for start in range(1, PRODUCTS + 1, 1000):
        db.products.insert_many([product(n, rng) for n in range(start, min(start + 1000, PRODUCTS + 1))])
    db.sessions.insert_many([session(n, rng) for n in range(1, SESSIONS + 1)])
    for name in LARGE_SIZES:
        db.sessions.insert_one(large(name, 1))
    print(f"demo MongoDB database shop created: products ({PRODUCTS}, int _id), sessions ({SESSIONS} mixed _id types "
          f"and {len(LARGE_SIZES)} documents of 1 to 12 MB)")  # fmt: skip


class Workload:
    """The demo's writes, one at a time: ``write_one`` picks and runs one (see the module docstring)."""

    def __init__(self, db: pymongo.database.Database, rng: random.Random) -> None:
        self.db, self.rng = db, rng
        self.next_product = (db.products.find_one(sort=[("_id", -1)]) or {"_id": PRODUCTS})["_id"] + 1
        self.deleted: list[Any] = []
        self.versions = dict.fromkeys(LARGE_SIZES, 1)
        self.last_large = time.monotonic()

    def write_one(self) -> None:
        db, rng = self.db, self.rng
        action = rng.random()
        number = rng.randint(1, self.next_product)
        if action < 0.2:
            db.products.insert_one(product(self.next_product, rng))
            self.next_product += 1
        elif action < 0.4:
            db.products.update_one({"_id": number}, {"$inc": {"stock": rng.randint(-3, 3)}, "$set": {"seen": True}})
        elif action < 0.5:
            db.products.update_one({"_id": number}, {"$set": {"dimensions.w": rng.random() * 100}})
        elif action < 0.55:
            db.products.update_one({"_id": number}, {"$unset": {"seen": ""}})
        elif action < 0.62:
            db.products.update_one({"_id": number}, {"$push": {"tags": f"new{rng.randint(1, 9)}"}})
        elif action < 0.66:
            db.products.update_one({"_id": number}, {"$pull": {"tags": {"$in": ["new1", "new2", "new3"]}}})
        elif action < 0.72:
            replacement = product(number, rng)
            replacement["name"] = f"Product {number} (replaced)"
            db.products.replace_one({"_id": number}, replacement)
        elif action < 0.8:
            key = session_id(rng.randint(1, SESSIONS))
            db.sessions.update_one({"_id": key}, {"$push": {"pages": f"/p/{number}"}, "$inc": {"cart.items": 1}})
        elif action < 0.88:
            key = session_id(rng.randint(1, SESSIONS))
            if db.sessions.delete_one({"_id": key}).deleted_count:
                self.deleted.append(key)
        elif action < 0.94 and self.deleted:
            key = self.deleted.pop(rng.randrange(len(self.deleted)))
            document = session(rng.randint(1, SESSIONS), rng)
            document["_id"] = key
            document["reinserted"] = True
            db.sessions.insert_one(document)
        else:
            db.products.delete_one({"_id": number})
        if time.monotonic() - self.last_large > 60:  # a new version of one large document a minute
            name = rng.choice(sorted(LARGE_SIZES))
            self.versions[name] += 1
            self.last_large = time.monotonic()
            db.sessions.replace_one({"_id": name}, large(name, self.versions[name]), upsert=True)


def workload(rate: float = 100.0) -> None:
    """Write at about ``rate`` writes per second until SIGINT or SIGTERM. A write the server refuses (the test
    server's H2 backend now and then fails an update of a document with a subdocument ``_id``: "Can not compare",
    docs/mongodb.md) changed nothing: it is reported on stderr and the workload goes on (it stopped the demo's
    MongoDB writes for good before)."""
    stop = False

    def handle(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    writes = Workload(connect()[DATABASE], random.Random(13))
    refused = 0
    while not stop:
        started = time.monotonic()
        try:
            writes.write_one()
        except pymongo.errors.OperationFailure as error:
            refused += 1
            print(f"MongoDB workload: the server refused a write ({refused} so far), skipped: {error}", file=sys.stderr)
        time.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))
    print(f"MongoDB workload stopped ({refused} writes refused by the server)")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "setup":
        setup()
    elif command == "workload":
        workload(float(sys.argv[2]) if len(sys.argv) > 2 else 100.0)
    else:
        sys.exit("usage: demo_mongo.py setup | workload [operations_per_second]")
