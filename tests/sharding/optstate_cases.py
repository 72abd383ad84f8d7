"""Rank functions for tests/sharding/test_optimizer_state_per_rank.py (module level: ranks are spawned)."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection
from torchrec.modules.embedding_configs import PoolingType

from .dmp_cases import build_sharded, global_batches, local_slice, optimizer, tables


def _train(model, rank, world_size, steps):
    per = 8 // world_size
    for kjt, upstream in global_batches(steps, 8, False)[:steps]:
        parts = model(local_slice(kjt, rank, world_size)).to_dict()
        out = torch.cat([parts[k] for k in kjt.keys()], dim=1)
        (out * upstream[rank * per : (rank + 1) * per]).sum().backward()


def _describe(sharded) -> dict:
    """A ShardedTensor's global metadata and local shards (offsets, sizes, values)."""
    return {
        "size": tuple(sharded.size()),
        "global": sorted(
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement)) for m in sharded.metadata().shards_metadata
        ),
        "local": [
            (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor.detach().clone())
            for s in sharded.local_shards()
        ],
    }


def fused_state(rank, world_size, shardings, optim_names, steps):
    """For each (sharding, optimizer): tpurec's and stock's `model.fused_optimizer` after `steps`
    steps from the same tables: params keys, state keys, and every ShardedTensor described; and the
    model's table ShardedTensors (the weight metadata a pointwise state follows)."""
    init = EmbeddingBagCollection(tables()).state_dict()
    out = {}
    for sharding in shardings:
        for name in optim_names:
            optim, kwargs = optimizer(name)
            for stock in (False, True):
                if stock and name == "adam":  # FBGEMM: "Optimizer adam is not supported in CPU mode"
                    continue
                model = build_sharded(rank, world_size, sharding, optim, kwargs, PoolingType.SUM, False, init, stock)
                _train(model, rank, world_size, steps)
                opt = model.fused_optimizer
                sd = opt.state_dict()
                out[(sharding, name, stock)] = {
                    "params": list(opt.params),
                    "weights": {k: _describe(v) for k, v in opt.params.items()},
                    "state": {
                        p: {k: _describe(v) if hasattr(v, "local_shards") else v.clone() for k, v in e.items()}
                        for p, e in sd["state"].items()
                    },
                    "tables": {k: _describe(v) for k, v in model.state_dict().items() if hasattr(v, "local_shards")},
                }
    return out


def dcp_with_dense_optimizer(rank, world_size, path, stock):
    """Per-table optimizers (t0 SGD, the others row-wise Adagrad), table-wise (rank 0: t0 and t2),
    saved and loaded with DCP next to a dense optimizer's state, as examples/quickstart.py does.
    Returns the fused optimizer's state keys and "ok" or the load's error."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    from tpurec.sharding.sharder import SparseCoreEBCSharder

    from .dmp_cases import GENERATORS, TABLES, _stock

    ebc = EmbeddingBagCollection(tables(), device=torch.device("meta"))
    for n, p in ebc.named_parameters():
        if ".t0." in n:
            apply_optimizer_in_backward(torch.optim.SGD, [p], {"lr": 0.1})
        else:
            apply_optimizer_in_backward(RowWiseAdagrad, [p], {"lr": 0.1, "eps": 1e-6})
    if stock:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        sharder = EmbeddingBagCollectionSharder()
        per_param = {n: _stock(GENERATORS["table_wise"](i, world_size)) for i, (n, _, _, _) in enumerate(TABLES)}
    else:
        sharder = SparseCoreEBCSharder(num_sparsecores=2)
        per_param = {n: GENERATORS["table_wise"](i, world_size) for i, (n, _, _, _) in enumerate(TABLES)}
    plan = ShardingPlan(
        {
            "": construct_module_sharding_plan(
                ebc, per_param, local_size=world_size, world_size=world_size, device_type="cpu", sharder=sharder
            )
        }
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    model = TorchrecDMP(
        ebc, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=False
    )
    dense = torch.nn.Linear(2, 2)
    dense_opt = KeyedOptimizerWrapper(dict(dense.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    dense(torch.ones(1, 2)).sum().backward()
    dense_opt.step()
    combined = CombinedOptimizer([model.fused_optimizer, ("dense", dense_opt)])
    state = {"model": model.state_dict(), "optim": combined.state_dict()}
    dcp.save(state, checkpoint_id=path)
    try:
        dcp.load(state, checkpoint_id=path)
        result = "ok"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        result = str(e).strip().splitlines()[-1]
    return {"keys": sorted(model.fused_optimizer.state_dict()["state"]), "load": result}
