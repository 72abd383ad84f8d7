"""Criteo-style Parquet data: schema, converter, streaming reader, synthetic generator."""
