"""Rank functions of the host-tier DMP tests (module level: spawned ranks import them).

A DMP over an EBC of three tables: t0 (1000 rows, two features) and t2 (2000 rows) may go to the host
tier with a cache of 10% of their rows; t1 (300 rows) stays resident. Every rank trains on its slice
of the same global batches (ids skewed towards low rows, so the caches hit and evict) with the loss
sum(output * a fixed random upstream gradient), and reports its losses and its shards of the tables
and optimizer state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import tpurec
from tpurec.embedding.host_tier.kernel import HostTierKernel

from .dmp_cases import local_slice, optimizer, shard_values

GLOBAL_BATCH = 16
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=2000, feature_names=["f3"]),
]
ROWS = [1000, 1000, 300, 2000]  # per feature
KEYS = ["f0", "f1", "f2", "f3"]
ON_HOST = ("t0", "t2")


def batches(steps: int) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(ROWS) * GLOBAL_BATCH,), generator=gen)
        values = []
        for k, rows in enumerate(ROWS):
            n = int(lengths[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH].sum())
            values.append((torch.rand(n, generator=gen) ** 3 * rows).long().clamp(max=rows - 1))
        kjt = KeyedJaggedTensor(keys=KEYS, values=torch.cat(values), lengths=lengths)
        out.append((kjt, torch.randn(GLOBAL_BATCH, 8 * 3 + 16, generator=gen)))
    return out


def constraints(algorithm: str | None) -> dict[str, ParameterConstraints]:
    """Table-wise for every table; with `algorithm` ("LRU" / "LFU"), t0 and t2 on the host tier (a
    tenth of their rows cached), in TorchRec's words; None: all resident."""
    out = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in TABLES}
    if algorithm is not None:
        for name in ON_HOST:
            out[name] = ParameterConstraints(
                sharding_types=["table_wise"],
                compute_kernels=["fused_uvm_caching"],
                cache_params=CacheParams(load_factor=0.1, algorithm=CacheAlgorithm[algorithm]),
            )
    return out


def build(optim: str, algorithm: str | None, plan=None, device: str = "cpu") -> tpurec.DistributedModelParallel:
    torch.manual_seed(0)  # the same tables on every rank and in every run
    ebc = EmbeddingBagCollection(TABLES)
    cls, kwargs = optimizer(optim)
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    if plan is not None:
        return tpurec.DistributedModelParallel(ebc, device=device, plan=plan)
    return tpurec.DistributedModelParallel(ebc, device=device, constraints=constraints(algorithm))


def steps(model, rank: int, world_size: int, data: list) -> torch.Tensor:
    """One step per batch on this rank's slice; this rank's losses."""
    per = GLOBAL_BATCH // world_size
    losses = []
    for kjt, upstream in data:
        parts = model(local_slice(kjt, rank, world_size)).to_dict()
        out = torch.cat([parts[k] for k in KEYS], dim=1)
        loss = (out * upstream[rank * per : (rank + 1) * per].to(out.device)).sum()
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def report(model, losses: torch.Tensor) -> dict:
    kernels = [m.kernel for m in model.module.sparsecore_lookups()]
    counters = {n: dataclasses.asdict(c) for k in kernels if k.host_tier for n, c in k.host_tier_counters().items()}
    cached = {n: len(t.cached_rows()) for k in kernels if k.host_tier for n, t in k.host_tier.items()}
    plan = model.plan.plan[""]
    out = {
        "losses": losses,
        "host_tier_kernels": sum(isinstance(k, HostTierKernel) for k in kernels),
        "counters": counters,
        "cached": cached,  # rows in the caches at the end of training (read before the state below empties them)
        "plan": {t: (ps.compute_kernel, ps.cache_params) for t, ps in plan.items()},
    }
    out["shards"] = {**shard_values(model.state_dict()), **shard_values(model.fused_optimizer.state_dict()["state"])}
    return out


def train(rank: int, world_size: int, optim: str, algorithm: str | None, n: int, device: str = "cpu") -> dict:
    model = build(optim, algorithm, device=device)
    return report(model, steps(model, rank, world_size, batches(n)))


def save_then_load(
    rank: int, world_size: int, optim: str, save_algorithm: str | None, load_algorithm: str | None, path: str,
    first: int, then: int, device: str = "cpu",
) -> dict:  # fmt: skip
    """Train `first` steps (host tier with `save_algorithm`, None: resident), save with DCP; a second
    model (`load_algorithm`) loads it and trains the `then` steps after."""
    data = batches(first + then)
    saver = build(optim, save_algorithm, device=device)
    first_losses = steps(saver, rank, world_size, data[:first])
    dcp.save({"model": saver.state_dict(), "optim": saver.fused_optimizer.state_dict()}, checkpoint_id=path)
    loader = build(optim, load_algorithm, device=device)
    state = {"model": loader.state_dict(), "optim": loader.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    loader.load_state_dict(state["model"])
    loader.fused_optimizer.load_state_dict(state["optim"])
    then_losses = steps(loader, rank, world_size, data[first:])
    return report(loader, torch.cat([first_losses, then_losses]))
