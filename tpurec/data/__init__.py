"""Criteo-style Parquet data: schema, converter, streaming reader, synthetic generator.

The names below load on first use, so `import tpurec.data` (and `tpurec --help`) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ParquetReader": "tpurec.data.reader",
    "DataError": "tpurec.data.schema",
    "DataSchema": "tpurec.data.schema",
    "SparseFeature": "tpurec.data.schema",
    "criteo_schema": "tpurec.data.schema",
    "dataset_metadata": "tpurec.data.schema",
    "split_train_eval": "tpurec.data.shards",
    "Unit": "tpurec.data.shards",
    "convert": "tpurec.data.convert",
    "ConvertOptions": "tpurec.data.convert",
    "synthesize": "tpurec.data.synth",
    "inspect_dataset": "tpurec.data.inspect",
    "ColumnSpec": "tpurec.data.mapping",  # Parquet tpurec did not write: its column mapping
    "open_source": "tpurec.data.mapped",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tpurec.data' has no attribute {name!r}")
