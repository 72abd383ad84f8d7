"""SparseCore embedding-bag kernels: input preprocessing, MOD table layout, lookup and fused updates.

`tpurec.embedding.SparseCoreEmbeddingBagCollection` is loaded on first use, so that importing this
package (as `tpurec --help` does) stays free of torchrec.
"""

__all__ = ["SparseCoreEmbeddingBagCollection"]


def __getattr__(name):
    if name == "SparseCoreEmbeddingBagCollection":
        from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

        return SparseCoreEmbeddingBagCollection
    raise AttributeError(f"module 'tpurec.embedding' has no attribute {name!r}")
