"""What TorchRec's managed-collision modules call on a lookup's table-batched kernel when they evict rows.

TorchRec's sharded MC-EBC / MC-EC (`torchrec/distributed/mc_embedding_modules.py`) keep, per table, the
group kernel's `_emb_module` (there: FBGEMM's TBE) and the table's index in the group, and on eviction call
`reset_embedding_weight_momentum(pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids)`,
then write `init_fn` of the evicted rows into the table's weight parameter. FBGEMM's TBE
(`split_table_batched_embeddings_ops_training.py`) resets only for exact row-wise Adagrad: its CUDA kernel
(`reset_weight_momentum_kernel`, split_embeddings_cache) sets each pruned row's weight and momentum1 to 0;
for every other optimizer it does nothing, so the rows keep their optimizer state. tpurec's group kernels
answer the same call on the SparseCore tables, with the same effect.

On a TPU every write of evicted rows has one shape whatever the number of rows (`write_rows`): the rows go
in chunks of `CHUNK`, a short chunk padded by repeating its first row and value (a row written twice with
the same value is the same row), so an eviction of any size reuses the same programs.
"""

from __future__ import annotations

from typing import Any

import torch

from tpurec.embedding.optimizers.rowwise_adagrad import RowWiseAdagradSpec
from tpurec.runtime.device import DeviceKind

CHUNK = 64  # rows per write of evicted rows on a device: one program shape for any eviction


def write_rows(target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor | float) -> None:
    """target[rows] = values (host rows; values host rows or a scalar), in place. On the host at once;
    on a device in fixed-shape chunks (module docstring)."""
    if target.device.type == DeviceKind.CPU:
        target[rows] = values if isinstance(values, float) else values.to(target.dtype)
        return
    for start in range(0, rows.numel(), CHUNK):
        part = rows[start : start + CHUNK]
        pad = CHUNK - part.numel()
        index = torch.cat([part, part[:1].expand(pad)]) if pad else part
        if isinstance(values, float):
            target[index.to(target.device)] = values
            continue
        chunk = values[start : start + CHUNK]
        chunk = torch.cat([chunk, chunk[:1].expand(pad, *chunk.shape[1:])]) if pad else chunk
        target[index.to(target.device)] = chunk.to(target.dtype).to(target.device)


class EvictedRowsReset:
    """`_emb_module` of a tpurec group kernel, as TorchRec's managed-collision modules use it."""

    def __init__(self, group: Any) -> None:
        self._group = group  # a kernel_module._SparseCoreGroupKernel

    @torch.no_grad()
    def reset_embedding_weight_momentum(
        self,
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        kernel = self._group.kernel
        if not isinstance(kernel.optimizer, RowWiseAdagradSpec):
            return  # as FBGEMM: only exact row-wise Adagrad resets anything
        offsets = pruned_indices_offsets.to("cpu", torch.long).tolist()
        for b, table_index in zip(buffer_ids.tolist(), logical_table_ids.tolist()):
            rows = pruned_indices[offsets[b] : offsets[b + 1]].to("cpu", torch.long)
            if rows.numel() == 0:
                continue
            _, kname, _ = self._group.shards[table_index]
            write_rows(kernel.read_weight(kname), rows, 0.0)  # views of the live storage: the writes land there
            for name in kernel.optimizer.state_names:
                write_rows(kernel.read_state(kname, name), rows, 0.0)
