"""SparseCore embedding kernels: input preprocessing, MOD table layout, lookup and fused updates.

`tpurec.embedding.SparseCoreEmbeddingBagCollection` (pooled) and
`tpurec.embedding.SparseCoreEmbeddingCollection` (sequence: one embedding per id) are loaded on first
use, so that importing this package (as `tpurec --help` does) stays free of torchrec.
"""

from typing import Any

__all__ = ["SparseCoreEmbeddingBagCollection", "SparseCoreEmbeddingCollection"]

_LAZY = {
    "SparseCoreEmbeddingBagCollection": "tpurec.embedding.module",
    "SparseCoreEmbeddingCollection": "tpurec.embedding.sequence_module",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpurec.embedding' has no attribute {name!r}")
