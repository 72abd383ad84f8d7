"""The training input pipeline of `tpurec train`: batches prepared ahead of the step.

`tpurec.data.prefetch.Prefetcher` decodes Parquet and cuts KJTs `depth` batches ahead for every plan.
On one rank it also builds each SparseCore lookup's CSR inputs ahead (`SparseCoreEmbeddingBag.
prepare`), because there the KJT a lookup receives is the batch's own, its features selected in the
lookup's order: TorchRec's input distribution moves no id between ranks. With several ranks a lookup's
ids come from the input all-to-all, so its CSR is built inside the step (`SparseCoreKernel.preprocess`
in the lookup's forward), after TorchRec's `TrainPipelineSparseDist` has overlapped that all-to-all
with the previous batch's compute.
"""

from __future__ import annotations

from tpurec.data.prefetch import Prefetcher


def lookups_to_prepare(dmp, world_size: int) -> list:
    """The pooled SparseCore lookups whose inputs can be built before input distribution."""
    if world_size != 1:
        return []
    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag

    found = []
    for sharded in dmp.modules():
        if hasattr(sharded, "sparsecore_lookups"):
            found += [m for m in sharded.sparsecore_lookups() if isinstance(m, SparseCoreEmbeddingBag)]
    return found


def make_prefetcher(reader, lookups: list, *, depth: int, workers: int) -> Prefetcher | None:
    """Batches of `reader` `depth` ahead, with the lookups' CSR inputs built on `workers` threads;
    None when depth is 0 (the caller reads inline)."""
    if depth == 0:
        return None
    positions: dict[int, list[int]] = {}  # per lookup: where its keys are in the batch's KJT

    def transform(batch):
        kjt = batch.sparse_features
        for m in lookups:
            perm = positions.get(id(m))
            if perm is None:
                index = {k: j for j, k in enumerate(kjt.keys())}
                perm = positions[id(m)] = [index[k] for k in m.feature_keys()]
            m.prepare(kjt if perm == list(range(len(kjt.keys()))) else kjt.permute(perm))
        return batch

    return Prefetcher(reader, transform if lookups else None, depth=depth, workers=workers)
