"""The PostgreSQL source: catalog, slot and publication, chunk reads, watermarks, and the change stream."""
