"""The fused optimizer of a sharded EBC or EC on tpurec's kernel, with ShardedTensor state for DCP.

TorchRec keys a fused optimizer by table (`embedding_bags.<table>.weight` for an EBC,
`embeddings.<table>.weight` for an EC) and gives every state a ShardedTensor with the table's
global metadata, so torch.distributed.checkpoint saves each rank's part and can reshard it. Each
rank keys only the tables it holds a shard of (stock's `EmbeddingFusedOptimizer` keys the tables of
its FBGEMM module). This does the same for SparseCore tables, following TorchRec's layout so
checkpoints line up (two differences, both for DCP: `optimizer_groups`, `ShardedSparseCoreOptimizer`):

* element-wise state (Adagrad's sum, Adam's moments) is sharded exactly like the table;
* row-wise state (row-wise Adagrad, one float per row and column shard) is 1-D: shard k in
  column order sits at offset k * rows + its row offset, as TorchRec's fused kernel lays it out.

Local shards are views of the kernels' natural-order storage (`tpurec.embedding.layout`), so an
in-place checkpoint load lands in the live tables; the base (`tpurec.embedding.fused_optimizer.
KernelFusedOptimizer`) handles step counts; this class only adds the ShardedTensor wrapping and the
row-wise layout.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from tpurec.embedding.fused_optimizer import KernelFusedOptimizer
from tpurec.embedding.optimizers.base import OptimizerSpec
from tpurec.embedding.optimizers.registry import spec_from_fused_params

if TYPE_CHECKING:
    import torch.distributed as dist


def local_shard(tensor: torch.Tensor, meta: ShardMetadata) -> Shard:
    """Shard(tensor, meta), placed on the device `tensor` is on: a host-tier table's shard lives in host
    memory (docs/host_tier.md) where the plan places the table on the rank's TPU, and a Shard must sit
    where its placement says."""
    placement = meta.placement
    if placement is not None and placement.device() != tensor.device:
        meta = ShardMetadata(meta.shard_offsets, meta.shard_sizes, f"rank:{placement.rank()}/{tensor.device}")
    return Shard(tensor, meta)


def _props(dtype: torch.dtype = torch.float32) -> TensorProperties:
    return TensorProperties(dtype=dtype, requires_grad=False)


class ShardedSparseCoreOptimizer(KernelFusedOptimizer):
    """The base's views, each rank's wrapped in one ShardedTensor per table and state."""

    # TorchRec's sharded fused optimizers show only "lr" in their param group; so do we, so that
    # param groups of checkpoints line up.
    expose_hyperparameters = False
    float32_lr = True  # stock's param group lr is FBGEMM's float32 learning rate read back

    def __init__(
        self, sharded_ebc: Any, tables: list[str], spec: OptimizerSpec | None
    ) -> None:  # a SparseCoreShardedMixin (sharded_state imports us)
        """The fused optimizer of `tables`, the module's SparseCore tables trained with `spec` (one
        optimizer config: `optimizer_groups`)."""
        self._ebc = sharded_ebc
        pg = sharded_ebc._env.process_group
        mine = set(tables)
        by_table = defaultdict(list)  # table -> [(kernel name, ShardMetadata, kernel)]
        for table, kname, meta, kmod in sharded_ebc._sc_shards():
            if table in mine:
                by_table[table].append((kname, meta, kmod.kernel))
        kernels = {id(k): k for parts in by_table.values() for _, _, k in parts}
        specs = {k.optimizer for k in kernels.values()}
        assert specs <= {spec}, f"tables {tables} grouped under {spec} are trained with {specs}"  # optimizer_groups
        # One step count for every table of this group on this rank: TorchRec checkpoints one per
        # table, and all of a rank's kernels step together (each backward updates every stack).
        every_table = [(k, t) for k in kernels.values() for t in k.table_names]
        params, state = {}, {}
        for table in tables:
            cfg = sharded_ebc._table_name_to_config[table]
            plan_spec = sharded_ebc.module_sharding_plan[table].sharding_spec
            assert plan_spec is not None, f"table {table} is sharded without a sharding spec"  # TorchRec sets one
            size = torch.Size([cfg.num_embeddings, cfg.embedding_dim])
            weight_meta = plan_spec.build_metadata(size, _props(sharded_ebc.stored_dtype(table)))
            state_meta = plan_spec.build_metadata(size, _props())  # state is float32 for any table dtype
            local = by_table.get(table, [])  # none for a table held elsewhere (`optimizer_groups`)
            weight = self._sharded(None, local, weight_meta, pg)
            params[f"{sharded_ebc.STATE_PREFIX}.{table}.weight"] = weight
            entry: dict[str, Any] = {}  # ShardedTensors and the step count
            for name in spec.state_names if spec else ():
                assert spec is not None
                if len(spec.state_shape(name, cfg.num_embeddings, cfg.embedding_dim)) == 1:
                    meta, offsets = _rowwise_metadata(state_meta, cfg.num_embeddings)
                    local_1d = [(kn, offsets[tuple(m.shard_offsets)], k) for kn, m, k in local]
                    st = self._sharded(name, local_1d, meta, pg)
                else:
                    st = self._sharded(name, local, state_meta, pg)
                entry[f"{table}.{name}"] = st
            if spec is not None and spec.keeps_step_count and every_table:  # a table-less rank counts none
                entry[f"{table}.step"] = self._step(every_table)
            # No state, no entry (SGD), where stock keeps an empty one: on a rank lacking some table's
            # shard (a ShardedTensor without local shards, which DCP drops), dcp.load re-flattens the
            # state_dict the pre-2.4 way, where a container holding no tensor is a leaf of its own, a
            # key no checkpoint holds ("Missing key in checkpoint state_dict: optim.state.<table>.
            # weight"); stock fails there (tests/sharding/test_optimizer_state_per_rank.py).
            if entry:
                state[weight] = entry
        super().__init__(list(kernels.values()), spec, params, state)

    def _sharded(
        self, state_name: str | None, local: list, metadata: ShardedTensorMetadata, pg: dist.ProcessGroup | None
    ) -> ShardedTensor:
        """The ShardedTensor of one table's weight (state_name None) or state over this rank's shards."""
        shards = []
        for kname, meta, kernel in local:
            value = kernel.read_weight(kname) if state_name is None else kernel.read_state(kname, state_name)
            # A view when contiguous (natural-order storage); a copy for a padded-width table.
            shards.append(local_shard(self._track(kernel, kname, state_name, value.contiguous()), meta))
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=pg)


def optimizer_groups(sharded: Any) -> list[tuple[OptimizerSpec | None, list[str]]]:
    """This rank's SparseCore tables grouped as stock TorchRec groups them into fused optimizers:
    [(spec, tables)], one group per kernel module of this rank (TorchRec's `group_tables` puts tables
    of one sharding type with the same fused params, dtype and pooling in one FBGEMM module, which
    keeps one `EmbeddingFusedOptimizer`), in the order the lookups hold them; so tables given
    different optimizers or learning rates train side by side, each group with its own param group.

    Only tables this rank holds a shard of, as stock (its `EmbeddingFusedOptimizer` keys the tables
    of its FBGEMM module): DCP loads each rank's own keys. Except where that leaves a rank no state
    tensor (it holds no table, or only SGD ones) while other tables have state: there stock's
    `dcp.load` of the fused optimizer fails as the comment in `ShardedSparseCoreOptimizer` says
    ("Missing key in checkpoint state_dict: optim"), so the rank also keys those tables, their state
    as ShardedTensors without local shards, grouped by sharding type and optimizer config, taken from
    the per-table fused params TorchRec keeps for every table (an EBC's sharding infos); where none
    is kept (an EC), from the module's one config."""
    groups: dict[Any, tuple[OptimizerSpec | None, list[str]]] = {}
    placed: set[str] = set()
    for table, _, _, kmod in sharded._sc_shards():
        if table not in placed:
            placed.add(table)
            groups.setdefault(id(kmod), (kmod.kernel.optimizer, []))[1].append(table)
    if any(spec is not None and spec.state_names for spec, _ in groups.values()):
        return list(groups.values())
    spec_of: dict[str, OptimizerSpec] = {}
    infos = getattr(sharded, "sharding_type_to_sharding_infos", None) or {}
    for infos_of_type in infos.values():
        for i in infos_of_type:
            spec_of.setdefault(i.embedding_config.name, spec_from_fused_params(i.fused_params, i.embedding_config.name))
    ours = sharded._sc_tables
    known = {spec for spec, _ in groups.values()} | {spec_of[t] for t in ours if t in spec_of}
    fallback = next(iter(known)) if len(known) == 1 else None
    for table in ours:
        spec = spec_of.get(table, fallback)
        if table in placed or spec is None or not spec.state_names:
            continue
        key = (sharded.module_sharding_plan[table].sharding_type, spec)
        groups.setdefault(key, (spec, []))[1].append(table)
    return list(groups.values())


def _rowwise_metadata(
    weight_meta: ShardedTensorMetadata, rows: int
) -> tuple[ShardedTensorMetadata, dict[tuple, ShardMetadata]]:
    """TorchRec's layout of row-wise state: 1-D, column shard k (in column order) at k * rows."""
    col_offsets = sorted({m.shard_offsets[1] for m in weight_meta.shards_metadata})
    shards, offsets = [], {}
    for m in weight_meta.shards_metadata:
        k = col_offsets.index(m.shard_offsets[1])
        off = k * rows + m.shard_offsets[0]
        shards.append(ShardMetadata(shard_offsets=[off], shard_sizes=[m.shard_sizes[0]], placement=m.placement))
        offsets[tuple(m.shard_offsets)] = shards[-1]
    meta = ShardedTensorMetadata(
        shards_metadata=shards, size=torch.Size([rows * len(col_offsets)]), tensor_properties=_props()
    )
    return meta, offsets
