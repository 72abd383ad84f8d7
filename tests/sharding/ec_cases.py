"""Rank functions for the multi-process EmbeddingCollection tests (module level: ranks are spawned)."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding.ec_sharder import SparseCoreECSharder

from .dmp_cases import copy_full_into_shards, local_slice, optimizer

DIM = 16
# t1 feeds two features; t2 is smaller than 2 ranks x 4 SparseCores x 8 rows.
TABLES = [("t0", 40, ["f0"]), ("t1", 27, ["f1", "f2"]), ("t2", 9, ["f3"])]
KEYS = [f for _, _, fs in TABLES for f in fs]


def tables():
    return [EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=fs) for n, r, fs in TABLES]


def global_batches(steps: int, batch: int, seed: int = 0):
    """(KJT, {feature: upstream gradient per id}) per step: sequences of 0..5 ids, some empty."""
    gen = torch.Generator().manual_seed(seed)
    rows = [r for _, r, fs in TABLES for _ in fs]
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (len(KEYS) * batch,), generator=gen)
        counts = lengths.view(len(KEYS), batch).sum(1).tolist()
        values = torch.cat([torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows, counts)])
        upstream = {k: torch.randn(n, DIM, generator=gen) for k, n in zip(KEYS, counts)}
        out.append((KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths), upstream))
    return out


def local_upstream(kjt: KeyedJaggedTensor, upstream: dict, rank: int, world_size: int) -> dict:
    """The rows of each feature's upstream gradient that belong to this rank's samples."""
    per = kjt.stride() // world_size
    d = kjt.to_dict()
    return {k: upstream[k][d[k].offsets()[rank * per] : d[k].offsets()[(rank + 1) * per]] for k in KEYS}


def _ours(gen):
    def wrapped(*args, **kwargs):
        return dataclasses.replace(gen(*args, **kwargs), compute_kernel=COMPUTE_KERNEL)

    return wrapped


def _stock(gen):
    def wrapped(*args, **kwargs):
        return dataclasses.replace(gen(*args, **kwargs), compute_kernel="fused")

    return wrapped


GENERATORS = {
    "table_wise": lambda i, ws: table_wise(rank=i % ws),
    "column_wise": lambda i, ws: column_wise(ranks=[(i + k) % ws for k in range(2)]),
    "row_wise": lambda i, ws: row_wise(),
}


def build_sharded(world_size, sharding, optim_name, init_state, stock=False):
    """TorchRec's DMP over a meta-device EC with tpurec's EC sharder (stock=True: TorchRec's fused kernel)."""
    optim, kwargs = optimizer(optim_name)
    ec = EmbeddingCollection(tables=tables(), device=torch.device("meta"))
    apply_optimizer_in_backward(optim, ec.parameters(), dict(kwargs))
    if stock:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        sharder, wrap = EmbeddingCollectionSharder(), _stock
    else:
        sharder, wrap = SparseCoreECSharder(num_sparsecores=4), _ours
    per_param = {n: wrap(GENERATORS[sharding](i, world_size)) for i, (n, _, _) in enumerate(TABLES)}
    module_plan = construct_module_sharding_plan(
        ec,
        per_param_sharding=per_param,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
        sharder=sharder,
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    model = TorchrecDMP(
        ec,
        env=env,
        device=torch.device("cpu"),
        plan=ShardingPlan({"": module_plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    if init_state is not None:
        copy_full_into_shards(model, init_state)
    return model


def gather_tables(model, rank):
    full = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            dst = torch.zeros(v.size(), dtype=v.dtype) if rank == 0 else None
            v.gather(dst=0, out=dst)
            full[k] = dst
    return full


def train(model, rank, world_size, steps):
    """Per step: this rank's {feature: values} (local samples); then the full tables (rank 0)."""
    outs = []
    for kjt, upstream in global_batches(steps, 8):
        local = local_slice(kjt, rank, world_size)
        out = model(local)
        outs.append({k: out[k].values().detach().clone() for k in KEYS})
        ups = local_upstream(kjt, upstream, rank, world_size)
        sum((out[k].values() * ups[k]).sum() for k in KEYS).backward()
    return outs


def run_case(rank, world_size, sharding, optim_name, init_state, steps, with_stock):
    result = {}
    model = build_sharded(world_size, sharding, optim_name, init_state)
    result["outs"] = train(model, rank, world_size, steps)
    result["tables"] = gather_tables(model, rank)
    if with_stock:
        stock = build_sharded(world_size, sharding, optim_name, init_state, stock=True)
        result["stock_outs"] = train(stock, rank, world_size, steps)
        result["stock_tables"] = gather_tables(stock, rank)
    return result


def run_with_planner(rank, world_size, init_state, steps):
    """tpurec.DistributedModelParallel, planned by tpurec's planner (no plan given), on a model holding an EC."""
    import tpurec

    optim, kwargs = optimizer("rowwise_adagrad")
    model = torch.nn.Module()
    model.ec = EmbeddingCollection(tables=tables(), device=torch.device("meta"))
    apply_optimizer_in_backward(optim, model.ec.parameters(), dict(kwargs))
    dmp = tpurec.DistributedModelParallel(model, device="cpu", topology=f"cpu-{world_size}", batch_size=8)
    sd = {f"ec.{k}": v for k, v in init_state.items()}
    copy_full_into_shards(dmp.module, sd)
    plan = {t: (ps.sharding_type, ps.compute_kernel) for t, ps in dmp.plan.plan["ec"].items()}
    outs = train(_Sub(dmp), rank, world_size, steps)
    return {"outs": outs, "tables": gather_tables(dmp.module, rank), "plan": plan}


class _Sub:
    """Calls the DMP-wrapped model's EC."""

    def __init__(self, dmp):
        self.dmp = dmp

    def __call__(self, kjt):
        return self.dmp.module.ec(kjt)


def checkpoint_save(rank, world_size, path, init_state, sharding, stock):
    import torch.distributed.checkpoint as dcp

    model = build_sharded(world_size, sharding, "sgd", init_state, stock=stock)
    train(model, rank, world_size, 2)
    dcp.save(model.state_dict(), checkpoint_id=path)
    kjt, _ = global_batches(1, 8, seed=9)[0]
    out = model(local_slice(kjt, rank, world_size))
    return {k: out[k].values().detach().clone() for k in KEYS}


def checkpoint_load(rank, world_size, path, sharding, stock):
    import torch.distributed.checkpoint as dcp

    model = build_sharded(world_size, sharding, "sgd", None, stock=stock)
    kjt, _ = global_batches(1, 8, seed=9)[0]
    local = local_slice(kjt, rank, world_size)
    with torch.no_grad():
        before = {k: v.values().clone() for k, v in model(local).items()}
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    with torch.no_grad():
        after = {k: v.values().clone() for k, v in model(local).items()}
    return {"before": before, "after": after}
