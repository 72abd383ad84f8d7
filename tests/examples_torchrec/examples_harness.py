"""Rank side: run one of TorchRec's example programs, read from a checkout at run time (never
committed here), with its `DistributedModelParallel` name bound to stock TorchRec's DMP or to
tpurec's, and record the loss of every training step.

Both runs go through the same wrapper around the DMP class, which after sharding gives the tables one
deterministic start (stock TorchRec re-initialises tables it shards on CPU, tpurec keeps or draws its
own) and re-seeds torch's generator, from which the examples' `RandomRecDataset` draws its batches.
Everything else is the example's own code with its own arguments.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

SEED = 0

# example name -> (directory under the checkout's examples/, module file)
EXAMPLES = {
    "golden_training": ("golden_training", "train_dlrm.py"),
    "golden_training_data_parallel": ("golden_training", "train_dlrm_data_parallel.py"),
    "two_tower": ("retrieval", "two_tower_train.py"),
}


def load_example(examples_dir: str, example: str):
    """Import the example's module from the checkout (the retrieval example imports its siblings as
    top-level `data`, `modules`, `knn_index`, as when run from its own directory)."""
    folder, filename = EXAMPLES[example]
    where = Path(examples_dir) / folder
    if example == "two_tower":
        import faiss

        # The retrieval example names faiss-gpu's index class in annotations evaluated at import;
        # faiss-cpu lacks it, and the CPU path (knn_index.get_index off CUDA) builds faiss.IndexIVFPQ.
        if not hasattr(faiss, "GpuIndexIVFPQ"):
            faiss.GpuIndexIVFPQ = faiss.IndexIVFPQ
    sys.path.insert(0, str(where))
    spec = importlib.util.spec_from_file_location(f"torchrec_example_{example}", where / filename)
    assert spec is not None and spec.loader is not None, f"{where / filename}: not a Python file"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_start(name: str, rows: int, cols: int) -> torch.Tensor:
    """One table's start: EBC's uniform(-1/sqrt(rows), 1/sqrt(rows)), from a generator per table."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    bound = rows**-0.5
    return (torch.rand(rows, cols, generator=gen) * 2 - 1) * bound


def _tables(model):
    """(state_dict key, table size, [(row offset, column offset, this rank's shard)]) for every
    embedding table; the shards are views of the live tables in stock TorchRec and in tpurec."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, value in model.state_dict().items():
        if "embedding_bags." not in key or not key.endswith(".weight"):
            continue
        if isinstance(value, ShardedTensor):  # sharded
            yield key, tuple(value.size()), [(*s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
        else:  # replicated (data-parallel)
            yield key, tuple(value.shape), [(0, 0, value)]


def set_tables(model) -> None:
    """Write every table's start, each rank its own shards."""
    with torch.no_grad():
        for key, size, shards in _tables(model):
            full = _table_start(key, *size)
            for r0, c0, shard in shards:
                shard.copy_(full[r0 : r0 + shard.shape[0], c0 : c0 + shard.shape[1]])


def table_shards(model) -> dict:
    """{key: (table size, [(row offset, column offset, copy of this rank's shard)])}."""
    return {key: (size, [(r0, c0, t.detach().clone()) for r0, c0, t in shards]) for key, size, shards in _tables(model)}


def assemble(ranks: list) -> dict:
    """Every table whole, from the ranks' `table_shards` (any plan)."""
    out: dict[str, Any] = {}
    for shards_by_key in ranks:
        for key, (size, shards) in shards_by_key.items():
            table = out.setdefault(key, torch.full(size, float("nan")))
            for r0, c0, t in shards:
                table[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
    return out


def _plan_summary(model) -> dict:
    out = {}
    for module_path, plan in model.plan.plan.items():
        for table, ps in plan.items():
            out[f"{module_path}.{table}"] = (ps.sharding_type, ps.compute_kernel)
    return out


def run(rank: int, world_size: int, examples_dir: str, example: str, dmp: str, kwargs: dict) -> dict:
    """Rank side: the example's `train(**kwargs)` with `DistributedModelParallel` bound to `dmp`
    ("stock" or "tpurec"); the example initialises the process group itself from the environment."""
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP

    from tpurec import DistributedModelParallel as TpurecDMP

    dmp_class = StockDMP if dmp == "stock" else TpurecDMP

    module = load_example(examples_dir, example)
    record: dict[str, Any] = {"losses": []}

    def same_start(*args, **kw):
        model = record["model"] = dmp_class(*args, **kw)
        set_tables(model)
        record["plan"] = _plan_summary(model)
        # the loss of every forward the example's pipeline runs: output (loss, (loss, logits, labels))
        model.register_forward_hook(lambda _m, _i, out: record["losses"].append(float(out[0].detach())))
        torch.manual_seed(SEED + 1)  # the batches, whatever sharding drew from the generator
        return model

    assert module.DistributedModelParallel.__module__ == "torchrec.distributed.model_parallel"
    module.DistributedModelParallel = same_start
    torch.manual_seed(SEED)  # the dense layers' start
    module.train(**kwargs)
    record["tables"] = table_shards(record.pop("model"))
    return record
