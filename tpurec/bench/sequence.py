"""`tpurec bench kernels --sequence`: an EmbeddingCollection training step, tpurec vs stock TorchRec.

Workload: 8 sequence features, one table each of 100k rows x dim 64, 256 users per step with 50
Zipf(1.05) ids each (102,400 ids per feature and step; `tpurec.bench.workloads`), every id looked
up unpooled. A step is forward + backward with row-wise Adagrad applied, side by side in one run:

* tpurec: SparseCoreEmbeddingCollection on the CPU reference (preprocessing included);
* torchrec: stock TorchRec's sharded EmbeddingCollection (DistributedModelParallel, one gloo rank,
  table-wise, its `fused` kernel: FBGEMM's CPU TBE in sequence mode with EXACT_ROWWISE_ADAGRAD),
  what a TorchRec user trains an EC with on CPU.

Both contestants run with the same torch thread count and start from the same tables (tpurec's
initial ones copied into TorchRec's); one step on the same ids is checked for equal work
(`tpurec.bench.equal_work`: the same looked-up rows and the same tables after the update) before
anything is timed. Then both take turns over the batches for several rounds, in a fresh random
order each round (`timer.interleaved`); the figure is the median of the per-round ratios
(torchrec seconds / tpurec seconds), reported with the worst and best round and the load average.
"""

from __future__ import annotations

import contextlib
import functools
from typing import cast

from tpurec.bench import timer, workloads

SEQ_TABLES, SEQ_ROWS, SEQ_DIM, SEQ_USERS, SEQ_LEN = 8, 100_000, 64, 256, 50


def _tables(num_tables, rows, dim):
    from torchrec.modules.embedding_configs import EmbeddingConfig

    return [
        EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]


def _values(out: dict):
    """Every looked-up row of every feature, one [ids, dim] tensor."""
    import torch

    return torch.cat([jt.values() for jt in out.values()])


def _tpurec(num_tables, rows, dim):
    from torchrec.optim import RowWiseAdagrad

    from tpurec.bench.contenders import Side
    from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

    m = SparseCoreEmbeddingCollection(
        _tables(num_tables, rows, dim), RowWiseAdagrad, {"lr": 0.01, "eps": 1e-8}, num_sparsecores=4, device="cpu"
    )

    def step(kjt, upstream):
        out = _values(m(kjt))
        out.backward(upstream)
        return out.detach()

    return Side("tpurec", step, lambda: [m.table_weight(f"t{i}") for i in range(num_tables)])


def _torchrec(num_tables, rows, dim, initial):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tpurec.bench.contenders import Side

    ec = EmbeddingCollection(tables=_tables(num_tables, rows, dim), device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.01, "eps": 1e-8})
    # ModuleSharder is invariant in its module type: cast as TorchRec's own default sharders are
    module_sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingCollectionSharder())
    plan = construct_module_sharding_plan(
        ec,
        per_param_sharding={f"t{i}": table_wise(rank=0, compute_kernel="fused") for i in range(num_tables)},
        local_size=1,
        world_size=1,
        device_type="cpu",
        sharder=module_sharder,
    )
    world = dist.group.WORLD
    assert world is not None  # the caller's process group
    model = DistributedModelParallel(
        ec,
        env=ShardingEnv.from_process_group(world),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[module_sharder],
        init_data_parallel=False,
    )

    def tables():  # one rank, table-wise: each table is its one local shard (a view of the TBE's weights)
        sd = model.state_dict()
        return [sd[f"embeddings.t{i}.weight"].local_shards()[0].tensor for i in range(num_tables)]

    with torch.no_grad():
        for w, src in zip(tables(), initial):
            w.copy_(src)

    def step(kjt, upstream):
        out = _values(model(kjt))
        out.backward(upstream)
        return out.detach()

    return Side("torchrec", step, tables)


@contextlib.contextmanager
def _single_process_group():
    """TorchRec's DMP needs a process group: a one-rank gloo group for the run, unless one exists."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_sequence(
    quick: bool = False,
    num_tables=SEQ_TABLES,
    rows=SEQ_ROWS,
    dim=SEQ_DIM,
    users=SEQ_USERS,
    seq_len=SEQ_LEN,
    rounds: int | None = None,
) -> dict:
    """Equal work checked once, then `rounds` rounds (default 7, quick 2) in random order; every
    round's ratio, the median, min and max, and the load average. UnequalWork if the check fails."""
    import numpy as np
    import torch

    from tpurec.bench import equal_work
    from tpurec.bench import rounds as rounds_mod

    rounds = rounds or (2 if quick else 7)
    rng = np.random.default_rng(0)
    keys = [f"f{i}" for i in range(num_tables)]
    batches = [
        workloads.kjt(
            workloads.fixed_pooling_ids(rng, num_tables, users, seq_len, rows, scatter_seed=workloads.SCATTER_SEED),
            keys,
        )
        for _ in range(3 if quick else 5)
    ]
    check_batch, batches = batches[0], batches[1:]
    ids = num_tables * users * seq_len
    upstream = equal_work.upstream_gradient(ids, dim)
    order_seed = rounds_mod.fresh_seed()
    load_start = rounds_mod.load_average()
    with _single_process_group():
        ours = _tpurec(num_tables, rows, dim)
        theirs = _torchrec(num_tables, rows, dim, [w.detach().clone() for w in ours.tables()])
        checked = equal_work.check(ours, theirs, check_batch, upstream)

        def one_pass(side) -> None:
            for b in batches:
                side.step(b, upstream)

        orders: list = []
        r_ours, r_theirs = timer.interleaved(
            [functools.partial(one_pass, side) for side in (ours, theirs)],
            warmup=1,
            repeats=rounds,
            orders=orders,
            seed=order_seed,
        )
    summary = rounds_mod.ratio_summary(r_ours.wall, r_theirs.wall)
    steps = len(batches)
    return {
        "workload": {
            "tables": num_tables,
            "rows": rows,
            "dim": dim,
            "users": users,
            "sequence_length": seq_len,
            "ids": "zipf(1.05)",
            "optimizer": "row-wise Adagrad",
            "peer": "stock TorchRec EmbeddingCollection, DMP 1 rank, fused (FBGEMM CPU TBE, sequence mode)",
        },
        "runs": [
            {
                "tpurec_ids_per_s": ids * steps / o,
                "torchrec_ids_per_s": ids * steps / t,
                "ratio_vs_torchrec": t / o,
                "first": ("tpurec", "torchrec")[order[0]],
            }
            for o, t, order in zip(r_ours.wall, r_theirs.wall, orders)
        ],
        "ratio_vs_torchrec": summary["ratio"],
        "min": summary["min"],
        "max": summary["max"],
        "tpurec_ids_per_s": ids * steps / r_ours.median,
        "torchrec_ids_per_s": ids * steps / r_theirs.median,
        "equal_work": checked,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "load_average": {"start": load_start, "end": rounds_mod.load_average()},
        "order_seed": order_seed,
    }


def format_sequence(r: dict) -> str:
    w = r["workload"]
    lines = [
        f"EmbeddingCollection training step, {w['tables']} tables x {w['rows']} rows x dim {w['dim']}, "
        f"{w['users']} users x {w['sequence_length']} ids, zipf(1.05), row-wise Adagrad",
        f"{'run':>4} {'tpurec M ids/s':>15} {'torchrec M ids/s':>17} {'ratio':>7}",
    ]
    for k, e in enumerate(r["runs"]):
        lines.append(
            f"{k:>4} {e['tpurec_ids_per_s'] / 1e6:>15.2f} {e['torchrec_ids_per_s'] / 1e6:>17.2f} "
            f"{e['ratio_vs_torchrec']:>6.2f}x"
        )
    la = r["load_average"]
    lines.append(
        f"median ratio vs stock TorchRec EC: {r['ratio_vs_torchrec']:.2f}x (worst round {r['min']:.2f}x, "
        f"best {r['max']:.2f}x; {r['rounds']} rounds in random order; load average {la['start'][0]} at start, "
        f"{la['end'][0]} at end)"
    )
    return "\n".join(lines)
