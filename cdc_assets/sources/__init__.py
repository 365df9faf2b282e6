"""Source dialects: one package per database kind (``postgres``), each supplying what differs between databases."""
