"""TPU adapter: registers the PrivateUse1 ("tpu") kernels of `torch.ops.tpurec.*` onto TorchTPU's ops.

Imported only by `tpurec.embedding.backend.load_tpu_backend()`, after `tpurec.runtime.device` has seen
torch_tpu, libtpu and TPU device nodes; never imported on a CPU-only run. Each kernel is a thin
call of the matching `torch.ops.tpu._sparse_dense_matmul*` op (TorchTPU 0.2.0 schemas, listed in
docs/kernels.md) plus a copy of the returned tensors back into the module's storage. The lookup's
call is here; each fused update's call lives with its optimizer (`tpu_update` in
`tpurec/embedding/optimizers/<name>.py`, listed by the spec's `tpu_kernels()`).

NOT YET RUN ON TPU HARDWARE. `tpurec selftest --device tpu` compares these kernels with the CPU
reference on a TPU host; the schemas are checked with meta tensors where torch_tpu is installed.
"""

from __future__ import annotations

import torch

from tpurec.embedding import ops
from tpurec.embedding.constraints import coo_entries_per_sc
from tpurec.embedding.optimizers import registry
from tpurec.embedding.optimizers.base import tpu_ops

_DISPATCH_KEY = "privateuseone"


def lookup(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    embedding_table: torch.Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
) -> torch.Tensor:
    return tpu_ops()._sparse_dense_matmul(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        device_batch_size,
        max_ids_per_partition,
        max_unique_ids_per_partition,
    )


def preprocess_with_torch_tpu(
    ids_int32: torch.Tensor,
    offsets_int32: torch.Tensor,
    *,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    batch_size: int,
    combiner: str,
    num_sc_per_device: int,
    allow_id_dropping: bool,
    table_name: str,
) -> dict[str, torch.Tensor]:
    """TorchTPU's C++ preprocessing (runs on the host CPU); returns its dict of tensors.

    The COO buffer is sized from the limits (every partition's 8-aligned segment on every local
    SparseCore): given 0, TorchTPU uses 128 entries and silently drops the rest, even with dropping off.
    """
    buffer = num_sc_per_device * coo_entries_per_sc(max_ids_per_partition, num_sc_per_device)
    return torch.ops.tpu.preprocess_sparse_dense_matmul_input(
        ids_int32,
        offsets_int32,
        max_ids_per_partition,
        max_unique_ids_per_partition,
        buffer,
        batch_size,
        combiner,
        1,
        1,
        num_sc_per_device,
        allow_id_dropping,
        table_name,
    )


def sparsecore_kernels() -> dict:
    """{tpurec op: its SparseCore kernel}: the lookup here, every optimizer's fused update from its spec."""
    out = {ops.sparse_dense_matmul: lookup}
    for spec in registry.spec_classes().values():
        out.update(spec.tpu_kernels())
    return out


def register(kernels: dict) -> None:
    """Make `kernels` ({tpurec op: kernel}: this chip's kind's, `kernel_kinds.device_kernels()`) the ops'
    PrivateUse1 ("tpu") kernels."""
    for op, kernel in kernels.items():
        op.register_kernel(_DISPATCH_KEY)(kernel)
