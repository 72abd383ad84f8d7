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

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Dict, List, Mapping

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import CacheParams, ParameterSharding, ShardingEnv, ShardingType

from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
from tpurec.embedding.settings import SETTINGS_KEY, KernelSettings, TableLimits
from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.errors import UserError
from tpurec.planner import stock_estimates
from tpurec.planner.host_tier_choice import host_tier_tables
from tpurec.planner.kernel_choice import COMPUTE_KERNEL, SHARDING_TYPES, sharding_types_for
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.host_input_dist import HostInputDistMixin
from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag
from tpurec.sharding.sharded_preprocess import (
    ModuleInputs,
    ShardedActivations,
    ShardedPreprocessed,
    compute_preprocessed,
    output_dist_activations,
)
from tpurec.sharding.sharded_state import SparseCoreShardedMixin, shard_slice


class SparseCoreGroupedLookup(GroupedPooledEmbeddingsLookup):
    def __init__(
        self, *args: Any, num_sc_per_device: int, cache_params: Mapping[str, CacheParams] | None = None, **kwargs: Any
    ) -> None:
        # read by _create_embedding_kernel during super().__init__
        self._num_sc_per_device = num_sc_per_device
        self._cache_params = cache_params  # the host-tier tables (host_tier_choice.host_tier_tables)
        super().__init__(*args, **kwargs)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        return SparseCoreEmbeddingBag(config, device, self._num_sc_per_device, sharding_type, self._cache_params)


def _sharding_type_of(sharding: object) -> ShardingType:
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
    raise UserError(f"tpurec's SparseCore kernel does not support sharding {name} (supported: {SHARDING_TYPES})")


class ShardedSparseCoreEBC(HostInputDistMixin, SparseCoreShardedMixin, ShardedEmbeddingBagCollection):
    STATE_PREFIX = "embedding_bags"
    CONFIGS_ATTR = "_embedding_bag_configs"

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Dict[str, Any] | None = None,
        device: torch.device | None = None,
        num_sc_per_device: int = DEFAULT_NUM_SPARSECORES,
        **kwargs: Any,
    ) -> None:
        self._num_sc_per_device = num_sc_per_device
        self._widen_tables = KernelSettings.from_fused(fused_params).widen_tables  # as every kernel reads it
        # tables the plan puts on the host tier (tpurec/embedding/host_tier/), read by _create_lookups
        self._host_tier_tables = host_tier_tables(table_name_to_parameter_sharding)
        super().__init__(
            module, table_name_to_parameter_sharding, env, fused_params=fused_params, device=device, **kwargs
        )
        self._adopt_sparsecore_optimizer()
        self._register_sparsecore_state()
        # Start from the unsharded module's weights when it has real ones (TorchRec only does this
        # off CPU); a module built on the meta device keeps the kernel's own init.
        source = {name: p for name, p in module.embedding_bags.named_parameters()}
        with torch.no_grad():
            for table, kname, meta, kmod in self._sc_shards():
                weight = source.get(f"{table}.weight")
                if weight is not None and not weight.is_meta:
                    kmod.kernel.write_weight(kname, shard_slice(weight, meta))

    def forward(self, *input: Any, **kwargs: Any) -> Any:
        # a batch field that feeds several sharded modules (step/inputs.py): this module's part
        if len(input) == 1 and not kwargs and isinstance(input[0], ModuleInputs):
            input = (input[0].part_for(self),)
        # SparseCore inputs built ahead (`preprocess_sharded`): only the device half, traceable by
        # torch.compile (tpurec/sharding/step/compiled.py); a KJT: TorchRec's whole forward
        if len(input) == 1 and not kwargs and isinstance(input[0], ShardedPreprocessed):
            return compute_preprocessed(self, input[0])
        # lookups run ahead (a pipelined step's SparseCore forward, step/pipelined.py): the output dist only
        if len(input) == 1 and not kwargs and isinstance(input[0], ShardedActivations):
            return output_dist_activations(self, input[0])
        return super().forward(*input, **kwargs)

    def input_dist(self, ctx: Any, features: Any, *args: Any, **kwargs: Any) -> Any:
        device = self._device
        kind = "cpu" if device is None else torch.device(device).type if isinstance(device, str) else device.type
        if kind != DeviceKind.CPU and getattr(features, "variable_stride_per_key", lambda: False)():
            # TorchRec expands a VBE lookup to the full batch on the output device with FBGEMM's
            # batch_index_select_dim0 (VariableBatchEmbeddingBagCollectionAwaitable), which has CPU
            # and CUDA kernels only; refused before the ids' collectives rather than inside them.
            raise UserError(
                "variable batch per feature (VBE KeyedJaggedTensors) is supported on a CPU device only: "
                f"on {kind}, TorchRec's VBE output path runs FBGEMM ops (batch_index_select_dim0) with CPU and "
                "CUDA kernels only"
            )
        return super().input_dist(ctx, features, *args, **kwargs)

    def _create_lookups(self) -> None:
        # the concrete shardings (TW, CW, RW, ...) hold the groups, process group and environment
        shardings: List[Any] = self._embedding_shardings
        for sharding in shardings:
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
                    cache_params=self._host_tier_tables,
                )
            )


def _settings_in_fused_params(
    fused_params: Dict[str, Any] | None, given: Dict[str, Any]
) -> tuple[Dict[str, Any], KernelSettings]:
    """(the fused params without kernel settings, the one KernelSettings the sharder carries): the
    fused params' own (a KernelSettings under SETTINGS_KEY, as another of these sharders carries it,
    or its fields as keys) with the settings `given` to the sharder over them."""
    fused = dict(fused_params or {})
    carried = KernelSettings.from_fused(fused)
    fused.pop(SETTINGS_KEY, None)
    as_keys = {k: fused.pop(k) for k in _SETTINGS_FIELDS if k in fused}
    return fused, replace(carried, **{**as_keys, **given})


_SETTINGS_FIELDS = tuple(f.name for f in fields(KernelSettings))


if TYPE_CHECKING:  # what the host sharder class (TorchRec's EBC or EC sharder) provides to the mixin
    from torchrec.distributed.embedding_types import BaseEmbeddingSharder, QuantizedCommCodecs
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    _SharderHost = BaseEmbeddingSharder[Any]
else:
    _SharderHost = object


class SparseCoreSharderMixin(_SharderHost):
    """What tpurec's EBC and EC sharders share: the kernel settings carried in fused params, the one
    compute kernel, and building the sharded module (`SHARDED_CLASS`) with the device's SparseCore
    count. `KERNEL_SETTINGS` names the settings a sharder takes beyond the common ones."""

    SHARDED_CLASS: type
    KERNEL_SETTINGS: tuple[str, ...] = ()

    def __init__(
        self,
        num_sparsecores: int | None = None,
        fused_params: Dict[str, Any] | None = None,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        allow_id_dropping: bool = False,
        qcomm_codecs_registry: Dict[str, QuantizedCommCodecs] | None = None,
        fixed_limits: bool | None = None,
        pad_dims: bool | None = None,
        widen_tables: bool | None = None,
        pooling_factors: Dict[str, float] | None = None,
        id_limits: Mapping[str, TableLimits | tuple[int, ...]] | None = None,
        settings: KernelSettings | None = None,
        **kernel_settings: Any,
    ) -> None:
        unknown = sorted(set(kernel_settings) - set(self.KERNEL_SETTINGS))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) {unknown}")
        loose = dict(
            max_ids_per_partition=max_ids_per_partition,
            max_unique_ids_per_partition=max_unique_ids_per_partition,
            allow_id_dropping=allow_id_dropping or None,
            fixed_limits=fixed_limits,
            pad_dims=pad_dims,
            widen_tables=widen_tables,
            id_limits=id_limits,
        )
        loose = {k: v for k, v in loose.items() if v is not None}  # None: not given
        if settings is not None:  # the object stands for the loose keywords (refused together)
            KernelSettings.of(settings, **loose)
            if not settings.stack_tables:
                raise UserError(f"{type(self).__name__}: settings.stack_tables=False is not supported by the sharders")
            loose = {f: v for f in _SETTINGS_FIELDS if (v := getattr(settings, f)) is not None and v is not False}
        # TorchRec hands fused params to every table's GroupedEmbeddingConfig, where the kernel
        # modules read them: the one KernelSettings, and the sharder's own settings (KERNEL_SETTINGS)
        fused, settings = _settings_in_fused_params(fused_params, loose)
        # the sharder's own settings are KernelSettings fields too: the one object carries them all
        settings = replace(settings, **{k: v for k, v in kernel_settings.items() if v is not None})
        fused.update(settings.fused())
        if pooling_factors:
            # a tuple of (table, ids per sample): TorchRec groups tables by hashing their fused params
            fused["pooling_factors"] = tuple(sorted((str(k), float(v)) for k, v in pooling_factors.items()))
        super().__init__(fused_params=fused, qcomm_codecs_registry=qcomm_codecs_registry)
        self.num_sparsecores = num_sparsecores
        # A patch of TorchRec's default planner estimators, made here where our sharder comes into
        # use, so stock DMP / shard_modules without a plan can price our kernel (stock_estimates.py).
        stock_estimates.install()

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [COMPUTE_KERNEL]

    def shard(
        self,
        module: Any,  # the host sharder's module type: an EmbeddingBagCollection or EmbeddingCollection
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        device_type = torch.device(device).type if device is not None else "cpu"
        return self.SHARDED_CLASS(
            module,
            params,
            env,
            fused_params=self.fused_params,
            device=device,
            num_sc_per_device=resolve_num_sparsecores(self.num_sparsecores, device_type),
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )


class SparseCoreEBCSharder(SparseCoreSharderMixin, EmbeddingBagCollectionSharder):
    """Shards EmbeddingBagCollections onto tpurec's SparseCore kernel.

    num_sparsecores: SparseCores per device (the MOD partitions inside a shard). None: the chip's own
    count on a TPU (a different explicit value is refused there), the topology's when
    tpurec.DistributedModelParallel builds the sharder, else 4 on CPU.
    max_ids_per_partition / max_unique_ids_per_partition / allow_id_dropping / fixed_limits: id-limit
    settings passed to every kernel (see SparseCoreKernel: limits are fixed on a TPU, from these or
    from the first batch; on CPU None follows each batch). id_limits: measured limits by table,
    {table: TableLimits} (or their positional tuples; `tpurec data stats`, read with
    id_limits.load_limits), fixed per stack as the sums of its tables'. pad_dims: store rows 8 floats wide as the
    SparseCore needs (default: on a TPU only). widen_tables: store FP16/BF16 tables as float32
    (default: on a TPU only, where TorchTPU's ops take float32 tables; tpurec.embedding.dtypes).
    settings: a KernelSettings instead of those keywords (stack_tables must stay True). Either way
    the sharder carries one KernelSettings in its fused params (KernelSettings.fused) to every kernel.
    """

    SHARDED_CLASS = ShardedSparseCoreEBC

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sharding_types_for(compute_device_type)
