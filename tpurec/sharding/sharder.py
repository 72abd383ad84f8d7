"""TorchRec sharder for EmbeddingBagCollection with tpurec's SparseCore kernel in every shard.

TorchRec keeps doing what it does well (planning, input/output distribution, ShardingPlan,
ShardedTensor state); only the compute kernel inside each shard changes. The pieces:

* `SparseCoreEBCSharder`: offers TW, CW, TWCW, RW and TWRW with compute kernel
  `customized_kernel` (see kernel_choice.py) on "cpu" and "tpu";
* `ShardedSparseCoreEBC`: TorchRec's ShardedEmbeddingBagCollection with its lookups built on
  `SparseCoreEmbeddingBag` and state_dict handling for the MOD-partitioned tables;
* `SparseCoreGroupedLookup`: TorchRec's grouped pooled lookup, creating our kernel.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType

from tpurec.embedding import dtypes
from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.sharding.kernel_choice import COMPUTE_KERNEL, SHARDING_TYPES
from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag


class SparseCoreGroupedLookup(GroupedPooledEmbeddingsLookup):
    def __init__(self, *args, num_sc_per_device: int, **kwargs) -> None:
        self._num_sc_per_device = num_sc_per_device  # read by _create_embedding_kernel during super().__init__
        super().__init__(*args, **kwargs)

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        return SparseCoreEmbeddingBag(config, device, self._num_sc_per_device, sharding_type)


def _sharding_type_of(sharding) -> ShardingType:
    name = type(sharding).__name__
    for prefix, st in (
        ("TwRw", ShardingType.TABLE_ROW_WISE),
        ("TwCw", ShardingType.TABLE_COLUMN_WISE),
        ("Tw", ShardingType.TABLE_WISE),
        ("Cw", ShardingType.COLUMN_WISE),
        ("Rw", ShardingType.ROW_WISE),
    ):
        if name.startswith(prefix):
            return st
    raise ValueError(f"tpurec's SparseCore kernel does not support sharding {name} (supported: {SHARDING_TYPES})")


class ShardedSparseCoreEBC(ShardedEmbeddingBagCollection):
    def __init__(
        self,
        module,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Dict[str, Any] | None = None,
        device: torch.device | None = None,
        num_sc_per_device: int = DEFAULT_NUM_SPARSECORES,
        **kwargs,
    ) -> None:
        self._num_sc_per_device = num_sc_per_device
        self._widen_tables = (fused_params or {}).get("widen_tables")  # as every kernel reads it
        super().__init__(
            module, table_name_to_parameter_sharding, env, fused_params=fused_params, device=device, **kwargs
        )
        self._sc_tables = [t for t, ps in self.module_sharding_plan.items() if ps.compute_kernel == COMPUTE_KERNEL]
        # TorchRec combined each kernel module's own optimizer; replace ours by one keyed per table
        # with ShardedTensor state (what DCP and TorchRec's checkpoints expect), keep any others.
        from torchrec.optim.keyed import CombinedOptimizer

        from tpurec.sharding.sharded_optimizer import ShardedSparseCoreOptimizer

        ours = {id(m.fused_optimizer) for _, _, _, m in self._sc_shards()}
        others = [(n, o) for n, o in self._optim._optims if id(o) not in ours]
        if self._sc_tables:
            self._optim = CombinedOptimizer([("", ShardedSparseCoreOptimizer(self))] + others)
        self._register_state_dict_hook(_emit_sharded_weights)
        self._register_load_state_dict_pre_hook(_consume_weights, with_module=True)
        # Start from the unsharded module's weights when it has real ones (TorchRec only does this
        # off CPU); a module built on the meta device keeps the kernel's own init.
        source = {name: p for name, p in module.embedding_bags.named_parameters()}
        with torch.no_grad():
            for table, kname, meta, kmod in self._sc_shards():
                weight = source.get(f"{table}.weight")
                if weight is not None and not weight.is_meta:
                    kmod.kernel.write_weight(kname, _slice(weight, meta))

    def reset_parameters(self) -> None:
        # SparseCore tables are initialised by their kernels (EBC's default bound, per table); let
        # TorchRec initialise the others.
        ours = {t for t, ps in self.module_sharding_plan.items() if ps.compute_kernel == COMPUTE_KERNEL}
        saved = self._embedding_bag_configs
        self._embedding_bag_configs = [c for c in saved if c.name not in ours]
        try:
            super().reset_parameters()
        finally:
            self._embedding_bag_configs = saved

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            configs = (
                sharding._grouped_embedding_configs_per_rank[sharding._rank]
                if isinstance(sharding, TwRwPooledEmbeddingSharding)
                else sharding._grouped_embedding_configs
            )
            self._lookups.append(
                SparseCoreGroupedLookup(
                    grouped_configs=configs,
                    pg=sharding._pg,
                    device=self._device,
                    sharding_type=_sharding_type_of(sharding),
                    env=sharding._env,
                    num_sc_per_device=self._num_sc_per_device,
                )
            )

    def stored_dtype(self, table: str) -> torch.dtype:
        """The dtype SparseCore table `table` is stored (and published in state_dict) in on this
        device: its config's, or float32 where the kernel widens it (every rank computes the same)."""
        cfg = self._table_name_to_config[table]
        device_type = self._device.type if self._device is not None else "cpu"
        return dtypes.stored_dtype(dtypes.table_dtype(cfg.data_type, table), device_type, self._widen_tables)

    def _sc_shards(self):
        """(table, kernel name, ShardMetadata, kernel module) for every SparseCore shard on this rank."""
        for lookup in self._lookups:
            for m in lookup.modules():
                if isinstance(m, SparseCoreEmbeddingBag):
                    for table, kname, meta in m.shards:
                        yield table, kname, meta, m


def _slice(full: torch.Tensor, meta) -> torch.Tensor:
    (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
    return full[r : r + nr, c : c + nc]


def _emit_sharded_weights(module: ShardedSparseCoreEBC, state_dict, prefix, local_metadata):
    """Publish each SparseCore table as a ShardedTensor in natural row order (as TorchRec's fused
    kernel does), so DCP, resharding and stock-TorchRec checkpoints all line up."""
    shards: Dict[str, List[Shard]] = {t: [] for t in module._sc_tables}
    for table, kname, meta, kmod in module._sc_shards():
        shards[table].append(Shard(kmod.kernel.read_weight(kname).contiguous(), meta))
    pg = module._env.process_group
    for table in module._sc_tables:
        cfg = module._table_name_to_config[table]
        spec = module.module_sharding_plan[table].sharding_spec
        metadata = spec.build_metadata(
            tensor_sizes=torch.Size([cfg.num_embeddings, cfg.embedding_dim]),
            tensor_properties=TensorProperties(dtype=module.stored_dtype(table)),
        )
        state_dict[f"{prefix}embedding_bags.{table}.weight"] = (
            ShardedTensor._init_from_local_shards_and_global_metadata(shards[table], metadata, process_group=pg)
        )
    return state_dict


def _consume_weights(
    module: ShardedSparseCoreEBC, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
):
    """Accept a ShardedTensor (DCP, another tpurec or stock TorchRec model) or a full tensor (an
    unsharded EBC's state_dict) for every SparseCore table and write this rank's shards."""
    mine: Dict[str, list] = {}
    for table, kname, meta, kmod in module._sc_shards():
        mine.setdefault(table, []).append((kname, meta, kmod))
    for table in module._sc_tables:
        key = f"{prefix}embedding_bags.{table}.weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        for kname, meta, kmod in mine.get(table, []):
            try:
                kmod.kernel.write_weight(kname, _local_piece(value, meta, table))
            except ValueError as e:
                error_msgs.append(f"{key}: {e}")


def _local_piece(value, meta, table: str) -> torch.Tensor:
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            if list(shard.metadata.shard_offsets) == list(meta.shard_offsets):
                return shard.tensor
        have = [list(s.metadata.shard_offsets) for s in value.local_shards()]
        raise ValueError(
            f"table {table!r}: this rank holds the shard at offsets {list(meta.shard_offsets)} but the loaded "
            f"ShardedTensor has local shards at {have}; load through torch.distributed.checkpoint (it reshards) "
            "or pass a full tensor"
        )
    return _slice(value, meta)


class SparseCoreEBCSharder(EmbeddingBagCollectionSharder):
    """Shards EmbeddingBagCollections onto tpurec's SparseCore kernel.

    num_sparsecores: SparseCores per device (the MOD partitions inside a shard). None: the chip's own
    count on a TPU (a different explicit value is refused there), the topology's when
    tpurec.DistributedModelParallel builds the sharder, else 4 on CPU.
    max_ids_per_partition / max_unique_ids_per_partition / allow_id_dropping / fixed_limits: id-limit
    settings passed to every kernel (see SparseCoreKernel: limits are fixed on a TPU, from these or
    from the first batch; on CPU None follows each batch). pad_dims: store rows 8 floats wide as the
    SparseCore needs (default: on a TPU only). widen_tables: store FP16/BF16 tables as float32
    (default: on a TPU only, where TorchTPU's ops take float32 tables; tpurec.embedding.dtypes).
    """

    def __init__(
        self,
        num_sparsecores: int | None = None,
        fused_params: Dict[str, Any] | None = None,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        allow_id_dropping: bool = False,
        qcomm_codecs_registry=None,
        fixed_limits: bool | None = None,
        pad_dims: bool | None = None,
        widen_tables: bool | None = None,
    ) -> None:
        fused = dict(fused_params or {})
        for key, value in (
            ("max_ids_per_partition", max_ids_per_partition),
            ("max_unique_ids_per_partition", max_unique_ids_per_partition),
            ("allow_id_dropping", allow_id_dropping or None),
            ("fixed_limits", fixed_limits),
            ("pad_dims", pad_dims),
            ("widen_tables", widen_tables),
        ):
            if value is not None:
                fused[key] = value
        super().__init__(fused_params=fused, qcomm_codecs_registry=qcomm_codecs_registry)
        self.num_sparsecores = num_sparsecores

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [COMPUTE_KERNEL]

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SHARDING_TYPES)

    def shard(self, module, params, env, device=None, module_fqn=None) -> ShardedSparseCoreEBC:
        device_type = torch.device(device).type if device is not None else "cpu"
        return ShardedSparseCoreEBC(
            module,
            params,
            env,
            fused_params=self.fused_params,
            device=device,
            num_sc_per_device=resolve_num_sparsecores(self.num_sparsecores, device_type),
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
