"""Rank functions for the managed-collision DMP tests (module level: ranks are spawned).

One model, a TorchRec MC-EBC (or MC-EC) of two tables over raw ids, sharded row-wise (the only sharding
TorchRec allows for managed-collision modules) by stock TorchRec's DMP or by tpurec's; both start from
the same tables and train on the same batches, and each rank returns what the test compares."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ZCH = {"t0": 32, "t1": 16}  # rows = remap slots
DIMS = {"t0": 8, "t1": 16}
RAW_IDS = 400  # distinct raw ids: many more than slots, so rows are evicted
BATCH = 8  # per rank


class _Wrap(nn.Module):
    def __init__(self, mc: nn.Module) -> None:
        super().__init__()
        self.mc = mc

    def forward(self, kjt):
        return self.mc(kjt)


def _policy(name: str):
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

    return {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}[name]()


def _hash_zch(tables: Any, policy: str = "hash_zch", buckets: int = 2) -> dict:
    """Multi-probe ZCH (fbgemm's zero_collision_hash; tpurec inserts on the host): `hash_zch` LRU within the
    probe range, `hash_zch_ttl` TorchRec's single TTL of 1 hour, `hash_zch_plain` no eviction; 2 buckets,
    a multiple of the world sizes tested."""
    from torchrec.modules.hash_mc_evictions import HashZchEvictionConfig, HashZchEvictionPolicyName
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    names = {
        "hash_zch": HashZchEvictionPolicyName.LRU_EVICTION,
        "hash_zch_ttl": HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
        "hash_zch_plain": None,
    }
    return {
        t.name: HashZchManagedCollisionModule(
            zch_size=t.num_embeddings,
            device=torch.device("cpu"),
            total_num_buckets=buckets,
            max_probe=4,
            input_hash_size=RAW_IDS,
            name=t.name,
            eviction_policy_name=names[policy],
            eviction_config=HashZchEvictionConfig(features=t.feature_names, single_ttl=1) if names[policy] else None,
        )
        for t in tables
    }


def build(policy: str, bagged: bool = True, buckets: int = 2) -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    meta = torch.device("meta")
    tables: Any
    collection: Any
    if bagged:
        tables = [
            EmbeddingBagConfig(name=t, embedding_dim=DIMS[t], num_embeddings=n, feature_names=[f"f{t[1]}"])
            for t, n in ZCH.items()
        ]
        collection = EmbeddingBagCollection(tables, device=meta)
    else:
        tables = [
            EmbeddingConfig(name=t, embedding_dim=8, num_embeddings=n, feature_names=[f"f{t[1]}"])
            for t, n in ZCH.items()
        ]
        collection = EmbeddingCollection(tables, device=meta)
    mcs: Any = (
        _hash_zch(tables, policy, buckets)
        if policy.startswith("hash_zch")
        else {
            t.name: MCHManagedCollisionModule(
                zch_size=t.num_embeddings,
                device=torch.device("cpu"),
                eviction_interval=2,
                input_hash_size=RAW_IDS,
                eviction_policy=_policy(policy),
            )
            for t in tables
        }
    )
    mcc = ManagedCollisionCollection(managed_collision_modules=mcs, embedding_configs=tables)
    if bagged:
        return _Wrap(ManagedCollisionEmbeddingBagCollection(collection, mcc, return_remapped_features=True))
    return _Wrap(ManagedCollisionEmbeddingCollection(collection, mcc, return_remapped_features=True))


def batches(steps: int, rank: int):
    """Skewed raw ids (a few hot, a long tail): some ids stay, the tail churns through the slots."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(11 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (2 * BATCH,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen)
        values = (u**3 * RAW_IDS).long()  # density falls with the id: low ids are hot
        out.append(KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths))
    return out


def make_dmp(rank: int, world: int, impl: str, policy: str, optimizer: str, bagged: bool, table_seed: int = 3) -> Any:
    """The model sharded by `impl` (stock, tpurec, tpurec-planned), its tables drawn from `table_seed`."""
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.planner.kernel_choice import COMPUTE_KERNEL

    torch.manual_seed(0)
    model: Any = build(policy, bagged)
    from torchrec.optim import RowWiseAdagrad

    opt = {
        "sgd": (torch.optim.SGD, {"lr": 0.05}),
        "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-3}),
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.05, "eps": 1e-3}),
    }
    cls, kwargs = opt[optimizer]
    # the tables only: the hash remap keeps its identities as frozen parameters
    apply_optimizer_in_backward(cls, model.mc._embedding_module.parameters(), kwargs)
    stock_sharder: Any = (
        ManagedCollisionEmbeddingBagCollectionSharder() if bagged else ManagedCollisionEmbeddingCollectionSharder()
    )
    kernel = "fused" if impl == "stock" else COMPUTE_KERNEL
    plan = ShardingPlan(
        {
            "mc": construct_module_sharding_plan(
                model.mc,
                {t: row_wise(compute_kernel=kernel) for t in ZCH},
                sharder=stock_sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )
    if impl == "stock":
        dmp = TorchrecDMP(model, device=torch.device("cpu"), plan=plan, sharders=[stock_sharder])
    elif impl == "tpurec":  # TorchRec's own MC sharder given: tpurec swaps its inner sharder for the SparseCore one
        dmp = tpurec.DistributedModelParallel(model, device="cpu", plan=plan, sharders=[stock_sharder])
    else:  # "tpurec-planned": tpurec's default sharders and planner
        dmp = tpurec.DistributedModelParallel(model, device="cpu")
        assert {(p.sharding_type, p.compute_kernel) for p in dmp.plan.plan["mc"].values()} == {("row_wise", kernel)}
    # the same starting tables on both (each DMP draws its own init)
    seeded = torch.Generator().manual_seed(table_seed)
    full = {t: torch.randn(n, DIMS[t] if bagged else 8, generator=seeded) for t, n in ZCH.items()}
    prefix = "mc._embedding_module." + ("embedding_bags" if bagged else "embeddings")
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for t in ZCH:
                if key == f"{prefix}.{t}.weight":
                    for shard in value.local_shards():
                        r, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                        shard.tensor.copy_(full[t][r : r + n])
    return dmp


def _loss(out: Any, bagged: bool) -> torch.Tensor:
    values = out.values() if bagged else torch.cat([jt.values() for jt in out.values()])
    weights = torch.linspace(-1, 1, values.numel()).view(values.shape).to(values.device)
    return (values * weights).sum() + (values**2).sum()


def run(rank: int, world: int, impl: str, policy: str, optimizer: str, bagged: bool, steps: int) -> dict:
    dmp = make_dmp(rank, world, impl, policy, optimizer, bagged)
    torch.manual_seed(100 + rank)  # the evictions' re-init draws from the global generator
    sharded: Any = dmp.module.mc
    evicted = []
    evict = sharded._evict

    (group,) = (
        [k for lookup in sharded._embedding_module._lookups for k in lookup._emb_modules] if impl != "stock" else [None]
    )
    resets = []  # (table, momentum of the evicted rows before and after TorchRec's eviction)

    def counting_evict(per_table):  # TorchRec's eviction, counted (rows reset per step)
        evicted.append(sum(int(v.numel()) for v in per_table.values() if v is not None))
        watch = group is not None and optimizer == "rowwise_adagrad"
        rows = {t: r.long() for t, r in per_table.items() if r is not None} if watch else {}
        before = {t: group.kernel.read_state(f"{t}/0", "momentum1")[r].clone() for t, r in rows.items()}
        evict(per_table)
        for t, r in rows.items():
            resets.append((t, before[t], group.kernel.read_state(f"{t}/0", "momentum1")[r].clone()))

    sharded._evict = counting_evict
    losses, remapped = [], []
    for kjt in batches(steps, rank):
        out, remap = dmp(kjt)
        loss = _loss(out, bagged)
        loss.backward()
        losses.append(float(loss.detach()))
        remapped.append(remap.values().clone())
    state = {}
    for key, value in dmp.state_dict().items():
        tensor = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
        state[key] = tensor.detach().clone()
    optim_state = {}
    for key, value in dmp.fused_optimizer.state_dict()["state"].items():
        for name, s in value.items():
            if hasattr(s, "local_shards") and s.local_shards():
                optim_state[f"{key}.{name}"] = s.local_shards()[0].tensor.detach().clone()
    return {
        "losses": losses,
        "remapped": remapped,
        "state": state,
        "optim": optim_state,
        "evicted": evicted,
        "resets": resets,
    }


def run_dcp(rank: int, world: int, save_impl: str, load_impl: str, path: str, policy: str, optimizer: str) -> dict:
    """`save_impl` trains 10 steps, saves model and fused optimizer with DCP, trains 10 more (the
    uninterrupted run); `load_impl`, built with other tables, loads the checkpoint and trains the same 10
    steps. MC state (remap identities, eviction metadata) travels too. Returns also each rank's state
    at the save and right after the load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    kjts = batches(20, rank)

    def steps(dmp: Any, part: list) -> list:
        torch.manual_seed(100 + rank)  # the evictions' re-init draws from the global generator
        out = []
        for kjt in part:
            emb, remap = dmp(kjt)
            _loss(emb, True).backward()
            out.append((float(_loss(emb, True).detach()), remap.values().clone()))
        return out

    saver = make_dmp(rank, world, save_impl, policy, optimizer, True)
    steps(saver, kjts[:10])
    dcp.save({"model": saver.state_dict(), "optim": saver.fused_optimizer.state_dict()}, checkpoint_id=path)
    at_save = _local_state(saver)
    uninterrupted = steps(saver, kjts[10:])
    dist.barrier()
    loader = make_dmp(rank, world, load_impl, policy, optimizer, True, table_seed=4)
    sd = {"model": loader.state_dict(), "optim": loader.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    loader.load_state_dict(sd["model"])
    loader.fused_optimizer.load_state_dict(sd["optim"])
    at_load = _local_state(loader)
    resumed = steps(loader, kjts[10:])
    return {"uninterrupted": uninterrupted, "resumed": resumed, "at_save": at_save, "at_load": at_load}


def _local_state(dmp: Any) -> dict:
    out = {}
    for key, value in dmp.state_dict().items():
        tensor = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
        out[key] = tensor.detach().clone()
    return out


def build_lru() -> nn.Module:
    """A `--model-module` target: the MC-EBC model with LRU eviction (tests/planner/test_plan_model_module.py)."""
    return build("lru", True)


def build_hash_zch() -> nn.Module:
    """A `--model-module` target: the MC-EBC model with the multi-probe hash remap, LRU within the probe,
    4 buckets (a multiple of the 4 ranks it is planned for)."""
    return build("hash_zch", True, buckets=4)


def build_hash_zch_2_buckets() -> nn.Module:
    """The same with 2 buckets: 4 ranks cannot share them (TorchRec's planner refuses it)."""
    return build("hash_zch", True, buckets=2)


def run_global_batch(rank: int, world: int, policy: str, steps: int) -> dict:
    """The global batch of 2 ranks (each rank's `batches`), trained at `world` ranks (1: the two batches
    in one, feature by feature in rank order, as the remap's input all-to-all orders them) by tpurec's DMP
    with SGD and a loss that sums over samples: 1 and 2 ranks make the same updates. Returns per step
    the loss and each feature's remapped ids of this rank's samples, and the full tables and remap
    identities (gathered over the ranks)."""
    import torch.distributed as dist
    from torchrec.modules import hash_mc_evictions
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # The eviction scores are wall-clock hours: a clock of TorchRec's eviction module alone that moves 2
    # hours a step, so ids unseen for a step expire (TTL 1 hour) and LRU slots age
    clock = {"hours": 500_000}

    class _Clock:
        @staticmethod
        def time() -> float:
            return clock["hours"] * 3600.0

    hash_mc_evictions.time = _Clock  # type: ignore[assignment]
    dmp = make_dmp(rank, world, "tpurec", policy, "sgd", True)
    sharded: Any = dmp.module.mc
    evicted: list[int] = []
    evict = sharded._evict

    def counting_evict(per_table: dict) -> None:
        evicted.append(sum(int(v.numel()) for v in per_table.values() if v is not None))
        evict(per_table)

    sharded._evict = counting_evict
    # evicted rows are re-initialised by init_fn: the same rows at 1 and 2 ranks, but their random draws
    # would come from each rank's generator; zeros instead
    for config in sharded._embedding_module._table_name_to_config.values():
        config.init_fn = torch.nn.init.zeros_
    per_rank = [batches(steps, r) for r in range(2)]
    mine = per_rank[rank] if world == 2 else [
        KeyedJaggedTensor.from_jt_dict({
            f: type(a[f])(values=torch.cat([a[f].values(), b[f].values()]),
                          lengths=torch.cat([a[f].lengths(), b[f].lengths()]))
            for f in ("f0", "f1")
        })
        for a, b in ((x.to_dict(), y.to_dict()) for x, y in zip(*per_rank))
    ]  # fmt: skip
    losses, remapped = [], []
    for kjt in mine:
        clock["hours"] += 2
        out, remap = dmp(kjt)
        values = out.values()
        loss = (values**2).sum() + values.sum()
        # TorchRec divides the tables' gradients by the world size (its all-to-all's gradient division):
        # the 2-rank update is half the summed gradient, so the 1-rank run takes half its loss's
        (loss / (2 // world)).backward()
        losses.append(float(loss.detach()))
        remapped.append({f: jt.values().clone() for f, jt in remap.to_dict().items()})
    tables = {}
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards") and any(k in key for k in ("weight", "_hash_zch_")):
            local = value.local_shards()[0].tensor.detach()
            if world == 1:
                tables[key] = local.clone()
                continue
            full = torch.zeros(value.size(), dtype=local.dtype) if rank == 0 else None
            value.gather(dst=0, out=full)
            tables[key] = full
    if world > 1:
        dist.barrier()
    return {"losses": losses, "remapped": remapped, "tables": tables, "evicted": evicted}
