"""SparseCore embedding-bag kernels: input preprocessing, MOD table layout, lookup and fused updates."""
