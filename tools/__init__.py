"""Command-line tools: the torture harness (``torture.py``) and the demo database (``demo_db.py``)."""
