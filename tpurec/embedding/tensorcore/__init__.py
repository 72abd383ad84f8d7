"""The SparseCore ops as JAX programs for the TensorCore, for TPUs without SparseCore (v5e).

The same ops (`torch.ops.tpurec.sparse_dense_matmul` and the fused updates) on the same CSR-wrapped
COO inputs, with the CPU reference's semantics (`tpurec.embedding.reference`): decode to fixed-size
entries (`csr_jax`), gather + segment sum (`lookup_jax`), sort-and-merge row gradients and functional
row updates (`update_jax`), jitted per static configuration (`programs`), and torch-facing kernels
(`torch_ops`). Every shape is static (fixed by the input buffers' sizes), so one program serves
every batch of a stack; hyper-parameters are runtime scalars.

This package imports jax at module top; nothing outside it imports it at import time, so tpurec
stays importable without jax.
"""
