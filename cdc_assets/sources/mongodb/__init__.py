"""The MongoDB source (issue #27), being built: so far ``bson_order`` (canonical extended JSON of documents and the
``_id`` order key in MongoDB's BSON comparison order). Imports ``bson`` (pymongo's) only."""
