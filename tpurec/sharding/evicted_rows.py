"""What TorchRec's managed-collision modules call on a lookup's table-batched kernel when they evict rows.

TorchRec's sharded MC-EBC / MC-EC (`torchrec/distributed/mc_embedding_modules.py`) keep, per table, the
group kernel's `_emb_module` (there: FBGEMM's TBE) and the table's index in the group, and on eviction call
`reset_embedding_weight_momentum(pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids)`,
then write `init_fn` of the evicted rows into the table's weight parameter. FBGEMM's TBE
(`split_table_batched_embeddings_ops_training.py`) resets only for exact row-wise Adagrad: its CUDA kernel
(`reset_weight_momentum_kernel`, split_embeddings_cache) sets each pruned row's weight and momentum1 to 0;
for every other optimizer it does nothing, so the rows keep their optimizer state. tpurec's group kernels
answer the same call on the SparseCore tables, with the same effect.
"""

from __future__ import annotations

from typing import Any

import torch

from tpurec.embedding.optimizers.rowwise_adagrad import RowWiseAdagradSpec


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
            weight = kernel.read_weight(kname)  # views of the live storage: the writes land there
            weight[rows.to(weight.device)] = 0.0
            for name in kernel.optimizer.state_names:
                state = kernel.read_state(kname, name)
                state[rows.to(state.device)] = 0.0
