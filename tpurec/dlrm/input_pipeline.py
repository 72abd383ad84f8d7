"""The training input pipeline of `tpurec train`: batches prepared ahead of the step.

`tpurec.data.prefetch.Prefetcher` decodes Parquet and cuts KJTs `depth` batches ahead for every plan.
On one rank it also builds each SparseCore lookup's CSR inputs ahead (`SparseCoreEmbeddingBag.
prepare`), because there the KJT a lookup receives is the batch's own, its features selected in the
lookup's order: TorchRec's input distribution moves no id between ranks. With several ranks a lookup's
ids come from the input all-to-all: `train_pipeline` then gives TorchRec's `TrainPipelineSparseDist`
the subclass of `tpurec.sharding.step.sparsecore_pipeline`, which builds them as soon as the all-to-all is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpurec.data.prefetch import Prefetcher

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim import Optimizer
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tpurec.data.reader import ParquetReader
    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag


def lookups_to_prepare(dmp: nn.Module, world_size: int) -> list[SparseCoreEmbeddingBag]:
    """The pooled SparseCore lookups whose inputs can be built before input distribution."""
    return sparsecore_lookups(dmp) if world_size == 1 else []


def sparsecore_lookups(dmp: nn.Module) -> list[SparseCoreEmbeddingBag]:
    """Every pooled SparseCore lookup of this rank."""
    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag
    from tpurec.sharding.sharded_state import SparseCoreShardedMixin

    found: list[SparseCoreEmbeddingBag] = []
    for sharded in dmp.modules():
        if isinstance(sharded, SparseCoreShardedMixin):
            found += [m for m in sharded.sparsecore_lookups() if isinstance(m, SparseCoreEmbeddingBag)]
    return found


def make_prefetcher(
    reader: ParquetReader, lookups: list[SparseCoreEmbeddingBag], *, depth: int, workers: int
) -> Prefetcher | None:
    """Batches of `reader` `depth` ahead, with the lookups' CSR inputs built on `workers` threads;
    None when depth is 0 (the caller reads inline)."""
    if depth == 0:
        return None
    positions: dict[int, list[int]] = {}  # per lookup: where its keys are in the batch's KJT

    def transform(batch: Batch) -> Batch:
        kjt = batch.sparse_features
        for m in lookups:
            perm = positions.get(id(m))
            if perm is None:
                index = {k: j for j, k in enumerate(kjt.keys())}
                perm = positions[id(m)] = [index[k] for k in m.feature_keys()]
            m.prepare(kjt if perm == list(range(len(kjt.keys()))) else kjt.permute(perm))
        return batch

    return Prefetcher(reader, transform if lookups else None, depth=depth, workers=workers)


def train_pipeline(
    dmp: nn.Module, optimizer: Optimizer, device: torch.device, *, world_size: int, workers: int, prepare: bool = True
) -> TrainPipelineSparseDist:
    """TorchRec's `TrainPipelineSparseDist`; with several ranks, one that builds every SparseCore
    lookup's CSR inputs on `workers` threads once the input all-to-all has delivered them
    (`tpurec.sharding.step.sparsecore_pipeline`; its `close()` stops them)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    if world_size == 1 or not prepare:
        return TrainPipelineSparseDist(dmp, optimizer, device)
    from tpurec.sharding.step.sparsecore_pipeline import SparseCoreTrainPipeline

    return SparseCoreTrainPipeline(dmp, optimizer, device, workers=workers)


def close_pipeline(pipeline: TrainPipelineSparseDist) -> None:
    """Stop the worker threads of a pipeline `train_pipeline` made (TorchRec's own has none)."""
    import sys

    module = sys.modules.get("tpurec.sharding.step.sparsecore_pipeline")  # loaded only if such a pipeline was built
    if module is not None and isinstance(pipeline, module.SparseCoreTrainPipeline):
        pipeline.close()
