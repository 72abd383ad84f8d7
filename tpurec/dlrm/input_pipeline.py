"""The training input pipeline of `tpurec train`: batches prepared ahead of the step.

`tpurec.data.prefetch.Prefetcher` decodes Parquet and cuts KJTs `depth` batches ahead for every plan.
On one rank it also builds each SparseCore lookup's CSR inputs ahead (`SparseCoreEmbeddingBag.
prepare`), because there the KJT a lookup receives is the batch's own, its features selected in the
lookup's order: TorchRec's input distribution moves no id between ranks. With several ranks a lookup's
ids come from the input all-to-all: `train_pipeline` then waits for batch i+1's all-to-all as soon
as TorchRec's `TrainPipelineSparseDist` has started it (after batch i's forward) and builds its CSR on
a worker thread while batch i's backward and optimizer step run; batch i+1's forward takes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.data.prefetch import Prefetcher

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim import Optimizer
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.utils import TrainPipelineContext

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
    lookup's CSR inputs on `workers` threads once the input all-to-all has delivered them."""
    from concurrent.futures import ThreadPoolExecutor

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import LazyNoWait

    if world_size == 1 or not prepare:
        return TrainPipelineSparseDist(dmp, optimizer, device)
    sharded: dict[str, Any] = {name: m for name, m in dmp.named_modules() if hasattr(m, "prepare_dist_input")}
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tpurec-csr")

    def module_for(name: str) -> Any:  # a sharded module with prepare_dist_input, or None
        # the pipeline names modules from the wrapped model; named_modules() from the DMP
        return next((m for fqn, m in sharded.items() if fqn == name or fqn.endswith("." + name)), None)

    class SparseCoreTrainPipeline(TrainPipelineSparseDist):
        def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
            super().wait_sparse_data_dist(context)
            for name, request in list(context.input_dist_tensors_requests.items()):
                module = module_for(name)
                if module is None:
                    continue
                # Wait now for the ids (TorchRec's own experimental pipelines do the same) and hand
                # forward the result unchanged.
                features = request.wait()
                context.input_dist_tensors_requests[name] = LazyNoWait(features)
                module.prepare_dist_input(features, pool.submit)

    return SparseCoreTrainPipeline(dmp, optimizer, device)
