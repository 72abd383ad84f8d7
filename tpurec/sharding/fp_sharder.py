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

from typing import TYPE_CHECKING, Any, Dict

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from tpurec.planner.planners import TpuPlanningFPSharder

if TYPE_CHECKING:
    from torchrec.distributed.embedding_types import QuantizedCommCodecs


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
