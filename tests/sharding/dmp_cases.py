"""Rank functions for the multi-process DMP tests (module level: ranks are spawned)."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding.sharder import SparseCoreEBCSharder

TABLES = [("t0", 40, 16, ["f0"]), ("t1", 27, 32, ["f1", "f2"]), ("t2", 64, 16, ["f3"])]


def tables(pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=fs, pooling=pooling)
        for n, r, d, fs in TABLES
    ]


def global_batches(steps: int, batch: int, weighted: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = [f for _, _, _, fs in TABLES for f in fs]
    rows = [r for _, r, _, fs in TABLES for _ in fs]
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
        values = torch.cat(
            [
                torch.randint(0, r, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=gen)
                for k, r in enumerate(rows)
            ]
        )
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        out.append(
            (
                KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights),
                torch.randn(batch, sum(d * len(fs) for _, _, d, fs in TABLES), generator=gen),
            )
        )
    return out


def local_slice(kjt: KeyedJaggedTensor, rank: int, world_size: int) -> KeyedJaggedTensor:
    """This rank's share of a global batch (contiguous samples), as each rank's data loader would give."""
    batch = kjt.stride()
    per = batch // world_size
    lo, hi = rank * per, (rank + 1) * per
    d = kjt.to_dict()
    keys = kjt.keys()
    values, lengths, weights = [], [], []
    for k in keys:
        jt = d[k]
        off = jt.offsets()
        values.append(jt.values()[off[lo] : off[hi]])
        lengths.append(jt.lengths()[lo:hi])
        if kjt.weights_or_none() is not None:
            weights.append(jt.weights()[off[lo] : off[hi]])
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights) if weights else None
    )


def _ours(gen, sharding_type=None):
    """torchrec's plan generator with tpurec's compute kernel (and optionally another sharding type)."""

    def wrapped(*args, **kwargs):
        ps = gen(*args, **kwargs)
        return dataclasses.replace(ps, compute_kernel=COMPUTE_KERNEL, sharding_type=sharding_type or ps.sharding_type)

    return wrapped


GENERATORS = {
    # table i on rank i % ws; column shards of 8 columns spread from rank i (wrapping, may repeat ranks)
    "table_wise": lambda i, ws: _ours(table_wise(rank=i % ws)),
    # every table on rank 0: the other ranks hold none (as 4 tables on 8 ranks leave 4)
    "table_wise_on_rank0": lambda i, ws: _ours(table_wise(rank=0)),
    "column_wise": lambda i, ws: _ours(column_wise(ranks=[(i + k) % ws for k in range(2)])),
    "table_column_wise": lambda i, ws: _ours(column_wise(ranks=[(i + k) % ws for k in range(2)]), "table_column_wise"),
    "row_wise": lambda i, ws: _ours(row_wise()),
    "table_row_wise": lambda i, ws: _ours(table_row_wise(host_index=0)),
}


def build_sharded(rank, world_size, sharding, optim, kwargs, pooling, weighted, init_state, stock=False):
    """DMP over a meta-device EBC with tpurec's sharder (or, stock=True, TorchRec's own fused kernel)."""
    ebc = EmbeddingBagCollection(tables(pooling), is_weighted=weighted, device=torch.device("meta"))
    apply_optimizer_in_backward(optim, ebc.parameters(), dict(kwargs))  # torchrec adds keys to it
    if stock:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        sharder = EmbeddingBagCollectionSharder()
        per_param = {n: _stock(GENERATORS[sharding](i, world_size)) for i, (n, _, _, _) in enumerate(TABLES)}
    else:
        sharder = SparseCoreEBCSharder(num_sparsecores=2)
        per_param = {n: GENERATORS[sharding](i, world_size) for i, (n, _, _, _) in enumerate(TABLES)}
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=per_param,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
        sharder=sharder,
    )
    plan = ShardingPlan({"": module_plan})
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    model = TorchrecDMP(
        ebc, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=False
    )
    if stock:
        copy_full_into_shards(model, init_state)
    else:
        model.load_state_dict(init_state)  # tpurec's sharded EBC also accepts full tensors
    return model


def copy_full_into_shards(model, full_state):
    """Write full (unsharded) tables into a stock TorchRec model's local shards."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if hasattr(value, "local_shards") and key in full_state:
                for shard in value.local_shards():
                    (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full_state[key][r : r + nr, c : c + nc])


def shard_values(state) -> dict:
    """{key: [(offsets, values)]} of every ShardedTensor this rank holds in `state` (nested dicts
    flattened with "/"): what a test compares by value, not only by shape."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in shard_values(value).items()})
        elif hasattr(value, "local_shards"):
            out[key] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    return out


def _stock(gen):
    def wrapped(*args, **kwargs):
        return dataclasses.replace(gen(*args, **kwargs), compute_kernel="fused")

    return wrapped


def train_sharded(rank, world_size, sharding, optim, kwargs, pooling, weighted, init_state, steps, stock=False):
    model = build_sharded(rank, world_size, sharding, optim, kwargs, pooling, weighted, init_state, stock)
    outs = []
    for kjt, upstream in global_batches(steps, 8, weighted):
        local = local_slice(kjt, rank, world_size)
        per = kjt.stride() // world_size
        kt = model(local)
        # TorchRec's sharded output lists features grouped by sharding; order them as the EBC does.
        parts = kt.to_dict()
        out = torch.cat([parts[k] for k in kjt.keys()], dim=1)
        outs.append(out.detach().clone())
        (out * upstream[rank * per : (rank + 1) * per]).sum().backward()
    # full tables gathered from the sharded state_dict (ShardedTensor -> full on rank 0)
    sd = model.state_dict()
    full = {}
    for k, v in sd.items():
        if hasattr(v, "local_shards"):
            dst = torch.zeros(v.size(), dtype=v.dtype) if rank == 0 else None
            v.gather(dst=0, out=dst)
            full[k] = dst
    return {"outs": outs, "tables": full}


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "rowwise_adagrad": (None, {"lr": 0.1, "eps": 1e-6}),  # torchrec.optim.RowWiseAdagrad, imported lazily
    "adam": (torch.optim.Adam, {"lr": 0.05, "eps": 1e-6}),
    # FBGEMM's L2 weight decay (the mode as FBGEMM's enum: stock TorchRec hands it to FBGEMM as is)
    "rowwise_adagrad_l2": (None, {"lr": 0.1, "eps": 1e-6, "weight_decay": 0.05, "weight_decay_mode": "L2"}),
}


def optimizer(name):
    cls, kwargs = OPTIMIZERS[name]
    if cls is None:
        from torchrec.optim import RowWiseAdagrad

        cls = RowWiseAdagrad
    kwargs = dict(kwargs)
    if "weight_decay_mode" in kwargs:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kwargs["weight_decay_mode"] = WeightDecayMode[kwargs["weight_decay_mode"]]
    return cls, kwargs


def run_cases(rank, world_size, cases, init_state, steps):
    """Train every case on this rank; return local outputs per step and full final tables (rank 0)."""
    results = []
    for case in cases:
        optim, kwargs = optimizer(case["optim"])
        pooling = PoolingType[case["pooling"]]
        result = train_sharded(
            rank, world_size, case["sharding"], optim, kwargs, pooling, case["weighted"], init_state, steps
        )
        if case.get("stock"):
            result["stock"] = train_sharded(
                rank,
                world_size,
                case["sharding"],
                optim,
                kwargs,
                pooling,
                case["weighted"],
                init_state,
                steps,
                stock=True,
            )
        results.append(result)
    return results


def eval_outputs(model, rank, world_size, steps=2):
    outs = []
    with torch.no_grad():
        for kjt, _ in global_batches(steps, 8, False, seed=7):
            parts = model(local_slice(kjt, rank, world_size)).to_dict()
            outs.append(torch.cat([parts[k] for k in kjt.keys()], dim=1))
    return outs


def checkpoint_save(rank, world_size, path, init_state, sharding, stock):
    """Train 2 steps with `sharding`, save with torch.distributed.checkpoint, return eval outputs."""
    import torch.distributed.checkpoint as dcp

    model = build_sharded(
        rank, world_size, sharding, torch.optim.SGD, {"lr": 0.5}, PoolingType.SUM, False, init_state, stock=stock
    )
    start = shard_values(model.state_dict())
    for kjt, upstream in global_batches(2, 8, False):
        per = 8 // world_size
        kt = model(local_slice(kjt, rank, world_size))
        (kt.values() * upstream[rank * per : (rank + 1) * per, : kt.values().shape[1]]).sum().backward()
    dcp.save(model.state_dict(), checkpoint_id=path)
    return {"outs": eval_outputs(model, rank, world_size), "start": start, "shards": shard_values(model.state_dict())}


def checkpoint_load(rank, world_size, path, sharding, stock):
    """A fresh model (other init, maybe other sharding and world size) loaded from `path`."""
    import torch.distributed.checkpoint as dcp

    fresh = EmbeddingBagCollection(tables()).state_dict()  # different random weights
    model = build_sharded(
        rank, world_size, sharding, torch.optim.SGD, {"lr": 0.5}, PoolingType.SUM, False, fresh, stock=stock
    )
    before = eval_outputs(model, rank, world_size)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    return {
        "before": before,
        "after": eval_outputs(model, rank, world_size),
        "shards": shard_values(model.state_dict()),
    }


def optimizer_checkpoint_save(rank, world_size, path, init_state, sharding, optim_name):
    """Train 2 steps, save model + fused optimizer with DCP, train 2 more: return those outputs."""
    import torch.distributed.checkpoint as dcp

    optim, kwargs = optimizer(optim_name)
    model = build_sharded(rank, world_size, sharding, optim, kwargs, PoolingType.SUM, False, init_state)
    start = shard_values(model.state_dict())
    batches = global_batches(4, 8, False)
    per = 8 // world_size

    def step(kjt, upstream):
        kt = model(local_slice(kjt, rank, world_size))
        parts = kt.to_dict()
        out = torch.cat([parts[k] for k in kjt.keys()], dim=1)
        (out * upstream[rank * per : (rank + 1) * per]).sum().backward()
        return out.detach()

    for kjt, up in batches[:2]:
        step(kjt, up)
    saved = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.save(saved, checkpoint_id=path)
    shards = shard_values(saved)
    return {"outs": [step(kjt, up) for kjt, up in batches[2:]], "start": start, "shards": shards}


def optimizer_checkpoint_resume(rank, world_size, path, sharding, optim_name, saved_world_size, in_place=False):
    """Resume from `path`. TorchRec averages embedding gradients over ranks, so at another world size
    the same global objective needs the local losses scaled by world_size / saved_world_size.
    in_place: only dcp.load into the tensors state_dict() returned, no load_state_dict (as TorchRec's
    tools do): the tables and optimizer state must still be restored."""
    import torch.distributed.checkpoint as dcp

    optim, kwargs = optimizer(optim_name)
    fresh = EmbeddingBagCollection(tables()).state_dict()
    model = build_sharded(rank, world_size, sharding, optim, kwargs, PoolingType.SUM, False, fresh)
    sd = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    if not in_place:
        model.load_state_dict(sd["model"])
        model.fused_optimizer.load_state_dict(sd["optim"])
    # what the model holds now, read back through state_dict() (not the dicts DCP loaded into)
    shards = shard_values({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()})
    batches = global_batches(4, 8, False)
    per = 8 // world_size
    outs = []
    for kjt, up in batches[2:]:
        kt = model(local_slice(kjt, rank, world_size))
        parts = kt.to_dict()
        out = torch.cat([parts[k] for k in kjt.keys()], dim=1)
        (out * up[rank * per : (rank + 1) * per] * (world_size / saved_world_size)).sum().backward()
        outs.append(out.detach())
    keys = sorted(model.fused_optimizer.state_dict()["state"])
    return {"outs": outs, "optim_keys": keys, "shards": shards}


def optimizer_checkpoint_roundtrip(rank, world_size, path, init_state, sharding, optim_name):
    """Train 2 steps, DCP-save model + fused optimizer, load into a fresh model in the same ranks (as
    the quickstart does; one spawn instead of two), train 2 more. Returns the saved shards, what the
    fresh model holds after loading, the outputs after the save from both models, and the optimizer's
    state keys."""
    import torch.distributed.checkpoint as dcp

    optim, kwargs = optimizer(optim_name)
    per = 8 // world_size
    batches = global_batches(4, 8, False)

    def step(model, kjt, upstream):
        parts = model(local_slice(kjt, rank, world_size)).to_dict()
        out = torch.cat([parts[k] for k in kjt.keys()], dim=1)
        (out * upstream[rank * per : (rank + 1) * per]).sum().backward()
        return out.detach()

    model = build_sharded(rank, world_size, sharding, optim, kwargs, PoolingType.SUM, False, init_state)
    for kjt, up in batches[:2]:
        step(model, kjt, up)
    saved = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.save(saved, checkpoint_id=path)
    saved_shards = shard_values(saved)
    fresh = build_sharded(
        rank, world_size, sharding, optim, kwargs, PoolingType.SUM, False, EmbeddingBagCollection(tables()).state_dict()
    )
    sd = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd["model"])
    fresh.fused_optimizer.load_state_dict(sd["optim"])
    loaded = shard_values({"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()})
    return {
        "shards": saved_shards,
        "loaded": loaded,
        "outs": [step(model, kjt, up) for kjt, up in batches[2:]],
        "resumed": [step(fresh, kjt, up) for kjt, up in batches[2:]],
        "optim_keys": sorted(fresh.fused_optimizer.state_dict()["state"]),
    }
