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
from torchrec.distributed.types import LazyAwaitable, LazyNoWait, ParameterSharding, ShardingEnv

from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
from tpurec.embedding.host_tier.kernel import refuse_unpooled
from tpurec.embedding.settings import KernelSettings
from tpurec.errors import UserError
from tpurec.planner.host_tier_choice import host_tier_tables
from tpurec.planner.kernel_choice import EC_SHARDING_TYPES
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.ec_preprocess import ShardedECPreprocessed, compute_preprocessed_ec, output_dist_activations_ec
from tpurec.sharding.host_input_dist import HostInputDistMixin
from tpurec.sharding.kernel_module import SparseCoreEmbedding
from tpurec.sharding.sequence_output import FixedSequenceOutput, ShardingPlan, assembled, lookup_planned
from tpurec.sharding.sharded_preprocess import ModuleInputs, ShardedActivations
from tpurec.sharding.sharded_state import SparseCoreShardedMixin
from tpurec.sharding.sharder import SparseCoreSharderMixin

if TYPE_CHECKING:
    from torchrec.distributed.embedding import EmbeddingCollectionContext
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import JaggedTensor

_POSITIONS = "tpurec_fixed_positions"  # each id's row in a sharding's received rows (sequence_output.py)


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
        self._widen_tables = KernelSettings.from_fused(fused_params).widen_tables  # as every kernel reads it
        on_host = host_tier_tables(table_name_to_parameter_sharding)
        if on_host:  # (unpooled kernels have no host tier yet)
            refuse_unpooled(sorted(on_host))
        # The TPU path (fixed limits: a tpu device, or asked for): outputs of fixed shapes on the device
        # (tpurec/sharding/sequence_output.py); elsewhere TorchRec's own output distribution.
        fixed = KernelSettings.from_fused(fused_params).fixed_limits
        on_tpu = device is not None and torch.device(device).type == DeviceKind.TPU
        cap = KernelSettings.from_fused(fused_params).max_ids_per_feature
        self._fixed_output = (
            FixedSequenceOutput(int(cap) if cap is not None else None) if (on_tpu if fixed is None else fixed) else None
        )
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

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> List[torch.Tensor]:
        if self._fixed_output is None:
            return super().compute(ctx, dist_input)
        return self._fixed_compute(ctx, dist_input)

    def output_dist(
        self, ctx: EmbeddingCollectionContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        if self._fixed_output is None:
            return super().output_dist(ctx, output)
        return LazyNoWait(self._fixed_jagged(ctx, output))

    def compute_and_output_dist(
        self, ctx: EmbeddingCollectionContext, input: KJTList
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        if self._fixed_output is None:
            return super().compute_and_output_dist(ctx, input)
        return LazyNoWait(self._fixed_jagged(ctx, self._fixed_compute(ctx, input)))

    def forward(self, *input: Any, **kwargs: Any) -> Any:
        # a batch field that feeds several sharded modules (step/inputs.py): this module's part
        if len(input) == 1 and not kwargs and isinstance(input[0], ModuleInputs):
            input = (input[0].part_for(self),)
        # the host half run ahead (`ec_preprocess.preprocess_sharded_ec`): only the device half, traceable
        # by torch.compile (tpurec/sharding/step/compiled.py); a KJT: TorchRec's whole forward
        if len(input) == 1 and not kwargs and isinstance(input[0], ShardedECPreprocessed):
            return compute_preprocessed_ec(self, input[0])
        # lookups run ahead (a pipelined step's SparseCore forward, step/pipelined.py): the rest only
        if len(input) == 1 and not kwargs and isinstance(input[0], ShardedActivations):
            return output_dist_activations_ec(self, input[0])
        return super().forward(*input, **kwargs)

    def _fixed_compute(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> List[torch.Tensor]:
        """Per sharding, the received rows [rounds x world x block rows, dim] on the device; each id's
        row in them goes on the sharding context (`fixed_positions`, host)."""
        return self._fixed_received(self._fixed_plans(ctx, dist_input))

    def _fixed_plans(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> List[ShardingPlan]:
        """`_fixed_compute`'s host half, per sharding (its SparseCore inputs, all-to-all indices)."""
        fixed = self._fixed_output
        assert fixed is not None
        if any(ctx.reverse_indices) or ctx.seq_vbe_ctx:
            raise UserError("the sharded EmbeddingCollection's TPU path takes neither index dedup nor VBE inputs")
        plans = []
        for i, (lookup, odist, features, sharding_ctx) in enumerate(
            zip(self._lookups, self._output_dists, dist_input, ctx.sharding_contexts)
        ):
            plan = fixed.plan_sharding(i, lookup, features, sharding_ctx, odist, self._fixed_device())
            setattr(sharding_ctx, _POSITIONS, plan.position)  # (host) for output_dist
            plans.append(plan)
        return plans

    def _fixed_received(self, plans: List[ShardingPlan], raw: Any = None) -> List[torch.Tensor]:
        """`_fixed_compute`'s device half: per sharding, its lookups (or, given `raw`, their outputs
        assembled from each stack's lookup run earlier: a pipelined step) and all-to-all."""
        fixed = self._fixed_output
        assert fixed is not None
        shardings: Dict[str, Any] = self._sharding_type_to_sharding
        out = []
        for i, (lookup, plan, sharding_type) in enumerate(zip(self._lookups, plans, shardings)):
            dim, device = self._embedding_dim_for_sharding_type(sharding_type), self._fixed_device()
            if raw is None:
                local = lookup_planned(lookup, plan.kernels, dim, device)
            else:
                local = assembled(lookup, plan.kernels, raw[i], dim, device)
            out.append(fixed.received(plan, local))
        return out

    def _fixed_device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    def _fixed_jagged(self, ctx: EmbeddingCollectionContext, output: List[torch.Tensor]) -> Dict[str, JaggedTensor]:
        fixed = self._fixed_output
        assert fixed is not None
        result: Dict[str, JaggedTensor] = {}
        for recv, sharding_ctx, names in zip(output, ctx.sharding_contexts, self._embedding_names_per_sharding):
            assert sharding_ctx.features_before_input_dist is not None
            result.update(
                fixed.jagged_tensors(
                    recv,
                    getattr(sharding_ctx, _POSITIONS),
                    sharding_ctx.features_before_input_dist,
                    names,
                    self._need_indices,
                    self._features_to_permute_indices,
                )
            )
        return result

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
