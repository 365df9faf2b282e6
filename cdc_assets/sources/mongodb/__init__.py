"""The MongoDB source (issue #27): ``dialect`` (``MongoDialect``, the generic pipeline's questions answered),
``catalog`` (captured collections, lake columns), ``snapshot`` (chunks over ``_id`` and their reads), ``stream``
(change-stream batches), ``watermark`` (positions, resume tokens, the settled rule), ``client`` (read-only clients,
errors without credentials, the current position) and ``bson_order`` (canonical extended JSON, the ``_id`` order
key). Only this package imports pymongo (``tests/test_package_layout.py``)."""
