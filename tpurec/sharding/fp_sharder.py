"""TorchRec's FeatureProcessedEmbeddingBagCollection (e.g. PositionWeightedModule) on SparseCore.

Nothing of TorchRec's sharded FP module is redone here: `ShardedFeatureProcessedEmbeddingBagCollection`
shards the inner EmbeddingBagCollection with whatever EBC sharder it is given, runs the feature
processors on each rank's distributed ids (after tagging each id with its position before the ids
are bucketised, under row-wise sharding) and hands the weighted ids to the inner lookups. Given
tpurec's `SparseCoreEBCSharder`, those lookups are the SparseCore kernel, which takes per-id weights
and passes their gradient back (tpurec.embedding.weight_grad), so the position weights train as in
stock TorchRec: dense parameters of the sharded module, all-reduced by DMP's DDP wrapper and stepped
by the dense optimizer.

The sharder offers what the inner sharder offers (tpurec's sharding types, `customized_kernel`).
Of what TorchRec's FP sharder offers, data-parallel is left out as for every SparseCore table
(kernel_choice.py), and so is grid sharding, which tpurec's EBC sharder does not build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Type

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from tpurec.planner.planners import TpuPlanningFPSharder
from tpurec.sharding.fp_preprocess import FPPreprocessed, compute_fp_preprocessed
from tpurec.sharding.sharded_preprocess import ModuleInputs

if TYPE_CHECKING:
    from torchrec.distributed.embedding_types import QuantizedCommCodecs


class ShardedSparseCoreFPEBC(ShardedFeatureProcessedEmbeddingBagCollection):
    """TorchRec's sharded FP-EBC whose forward also takes its inputs built ahead (`FPPreprocessed`, in a
    compiled step's batch: tpurec/sharding/fp_preprocess.py) and then runs only the device half."""

    def forward(self, *input: Any, **kwargs: Any) -> Any:
        if len(input) == 1 and not kwargs and isinstance(input[0], ModuleInputs):
            input = (input[0].part_for(self),)
        if len(input) == 1 and not kwargs and isinstance(input[0], FPPreprocessed):
            return compute_fp_preprocessed(self, input[0])
        return super().forward(*input, **kwargs)


class SparseCoreFPEBCSharder(TpuPlanningFPSharder):
    """TorchRec's FP-EBC sharder whose inner EBC sharder is tpurec's.

    ebc_sharder: the inner sharder (default: a `SparseCoreEBCSharder` built from `settings`, its
    keyword arguments: num_sparsecores, fused_params, id limits...)."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, QuantizedCommCodecs] | None = None,
        **settings: Any,
    ) -> None:
        if ebc_sharder is None:
            from tpurec.sharding.sharder import SparseCoreEBCSharder

            ebc_sharder = SparseCoreEBCSharder(qcomm_codecs_registry=qcomm_codecs_registry, **settings)
        elif settings:
            raise TypeError(f"settings {sorted(settings)} go to the EBC sharder; given one, set them there")
        super().__init__(ebc_sharder=ebc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedSparseCoreFPEBC:
        # TorchRec's shard(), building the subclass
        if device is None:
            device = torch.device("cuda")
        return ShardedSparseCoreFPEBC(
            module, params, ebc_sharder=self._ebc_sharder, env=env, device=device, module_fqn=module_fqn
        )

    @property
    def sharded_module_type(self) -> Type[ShardedSparseCoreFPEBC]:
        return ShardedSparseCoreFPEBC
