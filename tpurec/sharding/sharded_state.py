"""What tpurec's sharded EmbeddingBagCollection and EmbeddingCollection share: SparseCore shards,
their ShardedTensor state_dict, the fused optimizer keyed per table, and initialisation.

TorchRec leaves state_dict handling of `customized_kernel` tables to the sharded module (the
kernel stores them MOD-partitioned), so `SparseCoreShardedMixin` publishes each table as a
ShardedTensor in natural row order, as TorchRec's fused kernels do, and loads ShardedTensors (DCP,
another tpurec or stock TorchRec model) or full tensors (an unsharded module's state_dict). Keys are
`<STATE_PREFIX>.<table>.weight`: "embedding_bags" for the EBC, "embeddings" for the EC.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Dict, List

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from tpurec.embedding import dtypes
from tpurec.errors import UserError
from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding import table_params
from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag, _SparseCoreGroupKernel
from tpurec.sharding.sharded_host import ShardedHost
from tpurec.sharding.sharded_optimizer import local_shard

if TYPE_CHECKING:
    from torch.distributed._shard.metadata import ShardMetadata
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class SparseCoreShardedMixin(ShardedHost):
    """Mixed into a TorchRec sharded module (before it in the bases). The host class sets
    STATE_PREFIX and CONFIGS_ATTR (the attribute holding its table configs) and calls
    `_adopt_sparsecore_optimizer()` and `_register_sparsecore_state()` once its lookups exist."""

    STATE_PREFIX: str
    CONFIGS_ATTR: str
    _widen_tables: bool | None  # set by the host class from its fused params

    @property
    def _sc_tables(self) -> List[str]:
        return [t for t, ps in self.module_sharding_plan.items() if ps.compute_kernel == COMPUTE_KERNEL]

    def sparsecore_lookups(self) -> list:
        """This rank's SparseCore group kernels, one per lookup group (e.g. to build inputs ahead)."""
        return [m for lookup in self._lookups for m in lookup.modules() if isinstance(m, _SparseCoreGroupKernel)]

    def prepare_dist_input(self, features: Sequence[KeyedJaggedTensor], submit: Callable[..., Future]) -> None:
        """Start building the SparseCore inputs of this module's distributed input (the KJTList its
        input dist produced: one KJT per sharding type, in lookup order) on submit(fn, *args) ->
        Future. Each pooled SparseCore lookup takes its part (the lookup's group split, as TorchRec's
        grouped lookup cuts it) in forward when the ids match; others are left to forward."""
        for lookup, kjt in zip(self._lookups, features):
            splits, modules = getattr(lookup, "_feature_splits", None), getattr(lookup, "_emb_modules", None)
            if splits is None or modules is None or sum(splits) != len(kjt.keys()):
                continue
            for module, part in zip(modules, kjt.split(splits)):
                if isinstance(module, SparseCoreEmbeddingBag):
                    module.prepare_later(part, submit)

    def _sc_shards(self) -> Iterator[tuple[str, str, Any, _SparseCoreGroupKernel]]:  # (.., ShardMetadata, ..)
        """(table, kernel name, ShardMetadata, kernel module) for every SparseCore shard on this rank."""
        for lookup in self._lookups:
            for m in lookup.modules():
                if isinstance(m, _SparseCoreGroupKernel):
                    for table, kname, meta in m.shards:
                        yield table, kname, meta, m

    def stored_dtype(self, table: str) -> torch.dtype:
        """The dtype SparseCore table `table` is stored (and published in state_dict) in on this
        device: its config's, or float32 where the kernel widens it (every rank computes the same)."""
        cfg = self._table_name_to_config[table]
        device_type = self._device.type if self._device is not None else "cpu"
        return dtypes.stored_dtype(dtypes.table_dtype(cfg.data_type, table), device_type, self._widen_tables)

    def _adopt_sparsecore_optimizer(self) -> None:
        """TorchRec combined each kernel module's own optimizer; replace ours by one per kernel
        module, as stock has one per FBGEMM module (`optimizer_groups`: tables given different
        optimizers or learning rates train side by side), each keyed per table with ShardedTensor
        state (what DCP and TorchRec's checkpoints expect); keep any others."""
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

        from tpurec.sharding.sharded_optimizer import ShardedSparseCoreOptimizer, optimizer_groups

        ours = {id(m.fused_optimizer) for _, _, _, m in self._sc_shards()}
        others = [(n, o) for n, o in self._optim._optims if id(o) not in ours]
        if self._sc_tables:
            optims: List[KeyedOptimizer | tuple[str, KeyedOptimizer]] = []
            for spec, tables in optimizer_groups(self):
                optimizer = ShardedSparseCoreOptimizer(self, tables, spec)
                optims.append(("", optimizer))
                for table in tables:
                    self._in_backward_optimizers(table)[:] = [optimizer]  # what the table parameter names
            self._optim = CombinedOptimizer([*optims, *others])

    def _in_backward_optimizers(self, table: str) -> list:
        """The list table `table`'s parameter's `_in_backward_optimizers` is: filled with its fused
        optimizer when that is adopted, which happens after TorchRec has built the parameters."""
        return self.__dict__.setdefault("_sc_in_backward_optimizers", {}).setdefault(table, [])

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # TorchRec registers its tables' parameters here and skips `customized_kernel` ones; ours
        # go where it puts its own (tpurec/sharding/table_params.py).
        super()._initialize_torch_state(skip_registering)
        table_params.publish(self, self._in_backward_optimizers)

    def _register_sparsecore_state(self) -> None:
        self._register_state_dict_hook(_emit_sharded_weights)
        self._register_load_state_dict_pre_hook(_consume_weights, with_module=True)

    def reset_parameters(self) -> None:
        # SparseCore tables are initialised by their kernels (or loaded from the unsharded module);
        # let TorchRec initialise the others.
        ours = set(self._sc_tables)
        saved = getattr(self, self.CONFIGS_ATTR)
        setattr(self, self.CONFIGS_ATTR, [c for c in saved if c.name not in ours])
        try:
            super().reset_parameters()
        finally:
            setattr(self, self.CONFIGS_ATTR, saved)


def shard_slice(full: torch.Tensor, meta: ShardMetadata) -> torch.Tensor:
    (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
    return full[r : r + nr, c : c + nc]


def _emit_sharded_weights(
    module: SparseCoreShardedMixin, state_dict: dict[str, Any], prefix: str, local_metadata: object
) -> dict[str, Any]:
    """Publish each SparseCore table as a ShardedTensor in natural row order (as TorchRec's fused
    kernel does), so DCP, resharding and stock-TorchRec checkpoints all line up."""
    tables = module._sc_tables
    shards: Dict[str, List[Shard]] = {t: [] for t in tables}
    for table, kname, meta, kmod in module._sc_shards():
        shards[table].append(local_shard(kmod.kernel.read_weight(kname).contiguous(), meta))
    pg = module._env.process_group
    for table in tables:
        cfg = module._table_name_to_config[table]
        spec = module.module_sharding_plan[table].sharding_spec
        assert spec is not None, f"table {table} is sharded without a sharding spec"  # TorchRec sets one
        metadata = spec.build_metadata(
            tensor_sizes=torch.Size([cfg.num_embeddings, cfg.embedding_dim]),
            tensor_properties=TensorProperties(dtype=module.stored_dtype(table)),
        )
        state_dict[f"{prefix}{module.STATE_PREFIX}.{table}.weight"] = (
            ShardedTensor._init_from_local_shards_and_global_metadata(shards[table], metadata, process_group=pg)
        )
    return state_dict


def _consume_weights(
    module: SparseCoreShardedMixin,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: object,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Accept a ShardedTensor (DCP, another tpurec or stock TorchRec model) or a full tensor (an
    unsharded module's state_dict) for every SparseCore table and write this rank's shards."""
    mine: Dict[str, list] = {}
    for table, kname, meta, kmod in module._sc_shards():
        mine.setdefault(table, []).append((kname, meta, kmod))
    for table in module._sc_tables:
        key = f"{prefix}{module.STATE_PREFIX}.{table}.weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        for kname, meta, kmod in mine.get(table, []):
            try:
                kmod.kernel.write_weight(kname, _local_piece(value, meta, table))
            except UserError as e:
                error_msgs.append(f"{key}: {e}")


def _local_piece(value: torch.Tensor, meta: ShardMetadata, table: str) -> torch.Tensor:
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            if list(shard.metadata.shard_offsets) == list(meta.shard_offsets):
                return shard.tensor
        have = [list(s.metadata.shard_offsets) for s in value.local_shards()]
        raise UserError(
            f"table {table!r}: this rank holds the shard at offsets {list(meta.shard_offsets)} but the loaded "
            f"ShardedTensor has local shards at {have}; load through torch.distributed.checkpoint (it reshards) "
            "or pass a full tensor"
        )
    return shard_slice(value, meta)
