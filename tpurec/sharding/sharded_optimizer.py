"""The fused optimizer of a sharded EBC on tpurec's kernel, with ShardedTensor state for DCP.

TorchRec keys a fused optimizer by table (`embedding_bags.<table>.weight`) and gives every state a
ShardedTensor over all ranks, so torch.distributed.checkpoint saves each rank's part and can reshard
it. This does the same for SparseCore tables, following TorchRec's layout so checkpoints line up:

* element-wise state (Adagrad's sum, Adam's moments) is sharded exactly like the table;
* row-wise state (row-wise Adagrad, one float per row and column shard) is 1-D: shard k in
  column order sits at offset k * rows + its row offset, as TorchRec's fused kernel lays it out.

The kernels keep their partition-major storage; state_dict() refreshes natural-order copies and
load_state_dict() writes them back (`post_load_state_dict`).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from tpurec.embedding.fused_optimizer import KernelStateOptimizer


def _props():
    return TensorProperties(dtype=torch.float32, requires_grad=False)


class ShardedSparseCoreOptimizer(KernelStateOptimizer):
    def __init__(self, sharded_ebc) -> None:
        self._ebc = sharded_ebc
        pg = sharded_ebc._env.process_group
        by_table = defaultdict(list)  # table -> [(kernel name, ShardMetadata, kernel)]
        for table, kname, meta, kmod in sharded_ebc._sc_shards():
            by_table[table].append((kname, meta, kmod.kernel))
        kernels = {id(k): k for parts in by_table.values() for _, _, k in parts}
        specs = {k.optimizer for k in kernels.values()}
        if len(specs) > 1:
            raise ValueError(f"tables of one EmbeddingBagCollection use different fused optimizers: {specs}")
        spec = next(iter(specs)) if specs else None
        self._spec = spec
        self._entries = []  # (table, state name or None, kernel name, kernel, local tensor)
        params, state = {}, {}
        for table in sharded_ebc._sc_tables:
            cfg = sharded_ebc._table_name_to_config[table]
            plan_spec = sharded_ebc.module_sharding_plan[table].sharding_spec
            weight_meta = plan_spec.build_metadata(torch.Size([cfg.num_embeddings, cfg.embedding_dim]), _props())
            local = by_table.get(table, [])
            weight = self._sharded(table, None, local, weight_meta, pg, lambda k, n: k.read_weight(n))
            params[f"embedding_bags.{table}.weight"] = weight
            entry = {}
            for name in (spec.state_names if spec else ()):
                if spec.kind == "rowwise_adagrad":
                    meta, offsets = _rowwise_metadata(weight_meta, cfg.num_embeddings)
                    local_1d = [(kn, offsets[tuple(m.shard_offsets)], k) for kn, m, k in local]
                    st = self._sharded(table, name, local_1d, meta, pg, lambda k, n, s=name: k.read_state(n, s))
                else:
                    st = self._sharded(table, name, local, weight_meta, pg, lambda k, n, s=name: k.read_state(n, s))
                entry[f"{table}.{name}"] = st
            if spec is not None and spec.kind == "adam":
                entry[f"{table}.step"] = torch.tensor(0.0)
            state[weight] = entry
        group = {"params": list(params.values()), "lr": spec.lr if spec else 0.0}
        self._kernels = list(kernels.values())
        super().__init__(params, state, [group])
        self._ready = True
        for k in self._kernels:  # kernels read the learning rate from here at every update
            k._lr_group = group

    def _sharded(self, table, state_name, local, metadata, pg, read):
        shards = []
        for kname, meta, kernel in local:
            shards.append(Shard(read(kernel, kname).contiguous(), meta))
            self._entries.append((table, state_name, kname, kernel, shards[-1].tensor))
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=pg)

    def _kernels_version(self) -> tuple:
        return tuple(s for k in self._kernels for s in k.steps)

    def _refresh(self) -> None:
        with torch.no_grad():
            for _, state_name, kname, kernel, tensor in self._entries:
                src = kernel.read_weight(kname) if state_name is None else kernel.read_state(kname, state_name)
                tensor.copy_(src)
            steps = max((s for k in self._kernels for s in k.steps), default=0)
            for entry in self._state.values():
                for key, value in entry.items():
                    if key.endswith(".step"):
                        value.fill_(steps)

    def _write_back(self) -> None:
        for _, state_name, kname, kernel, tensor in self._entries:
            if state_name is not None:
                kernel.write_state(kname, state_name, tensor)
        for entry in self._state.values():
            for key, value in entry.items():
                if key.endswith(".step"):
                    for k in self._kernels:
                        k.steps = [int(value.item())] * len(k.steps)



def _rowwise_metadata(weight_meta: ShardedTensorMetadata, rows: int):
    """TorchRec's layout of row-wise state: 1-D, column shard k (in column order) at k * rows."""
    col_offsets = sorted({m.shard_offsets[1] for m in weight_meta.shards_metadata})
    shards, offsets = [], {}
    for m in weight_meta.shards_metadata:
        k = col_offsets.index(m.shard_offsets[1])
        off = k * rows + m.shard_offsets[0]
        shards.append(ShardMetadata(shard_offsets=[off], shard_sizes=[m.shard_sizes[0]], placement=m.placement))
        offsets[tuple(m.shard_offsets)] = shards[-1]
    meta = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([rows * len(col_offsets)]),
                                 tensor_properties=_props())
    return meta, offsets
