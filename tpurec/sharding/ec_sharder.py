"""TorchRec sharder for EmbeddingCollection (sequence embeddings) with tpurec's SparseCore kernel.

The EmbeddingBagCollection sharder's counterpart: TorchRec's ShardedEmbeddingCollection keeps its
sequence input/output distribution (ids out by all-to-all, one embedding per id back), and every
shard runs `SparseCoreEmbedding` (the pooled kernel with each id its own bag; tpurec.embedding.
sequence_kernel). Sharding types are the ones TorchRec offers for an EC, minus data-parallel (see
kernel_choice.py): table-wise, column-wise, row-wise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
from tpurec.planner.kernel_choice import EC_SHARDING_TYPES
from tpurec.sharding.host_input_dist import HostInputDistMixin
from tpurec.sharding.kernel_module import SparseCoreEmbedding
from tpurec.sharding.sharded_state import SparseCoreShardedMixin
from tpurec.sharding.sharder import SparseCoreSharderMixin

if TYPE_CHECKING:
    from torchrec.modules.embedding_modules import EmbeddingCollection


class SparseCoreGroupedSequenceLookup(GroupedEmbeddingsLookup):
    def __init__(self, *args: Any, num_sc_per_device: int, sharding_type: str, **kwargs: Any) -> None:
        # read by _create_embedding_kernel during super().__init__
        self._num_sc_per_device = num_sc_per_device
        self._sharding_type = sharding_type
        super().__init__(*args, **kwargs)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, pg, device, env)
        return SparseCoreEmbedding(config, device, self._num_sc_per_device, self._sharding_type)


class ShardedSparseCoreEC(HostInputDistMixin, SparseCoreShardedMixin, ShardedEmbeddingCollection):
    STATE_PREFIX = "embeddings"
    CONFIGS_ATTR = "_embedding_configs"

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Dict[str, Any] | None = None,
        device: torch.device | None = None,
        num_sc_per_device: int = DEFAULT_NUM_SPARSECORES,
        **kwargs: Any,
    ) -> None:
        self._num_sc_per_device = num_sc_per_device
        self._widen_tables = (fused_params or {}).get("widen_tables")  # as every kernel reads it
        # TorchRec's __init__ ends by loading the unsharded module's state_dict (when not on meta):
        # our state hooks must be in place by then, so they are registered in _initialize_torch_state.
        super().__init__(
            module, table_name_to_parameter_sharding, env, fused_params=fused_params, device=device, **kwargs
        )
        self._adopt_sparsecore_optimizer()

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        super()._initialize_torch_state(skip_registering)
        if not skip_registering and not getattr(self, "_sparsecore_state_registered", False):
            self._register_sparsecore_state()
            self._sparsecore_state_registered = True

    def _create_lookups(self) -> None:
        # the concrete shardings (TW, CW, RW) hold the groups, process group and environment
        shardings: Dict[str, Any] = self._sharding_type_to_sharding
        for sharding_type, sharding in shardings.items():
            self._lookups.append(
                SparseCoreGroupedSequenceLookup(
                    grouped_configs=sharding._grouped_embedding_configs,
                    pg=sharding._pg,
                    device=self._device,
                    env=sharding._env,
                    num_sc_per_device=self._num_sc_per_device,
                    sharding_type=sharding_type,
                )
            )


class SparseCoreECSharder(SparseCoreSharderMixin, EmbeddingCollectionSharder):
    """Shards EmbeddingCollections onto tpurec's SparseCore kernel (TW, CW, RW).

    Arguments as `SparseCoreEBCSharder`'s, plus max_ids_per_feature: the fixed number of ids per
    feature and batch a TPU's buffers are sized for (default there: twice the first batch's
    largest feature; on CPU the capacity follows each batch). See tpurec.embedding.sequence_kernel.
    """

    SHARDED_CLASS = ShardedSparseCoreEC
    KERNEL_SETTINGS = ("max_ids_per_feature",)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(EC_SHARDING_TYPES)
