"""`tpurec bench kernels --sequence`: an EmbeddingCollection training step, tpurec vs stock TorchRec.

Workload: 8 sequence features, one table each of 100k rows x dim 64, 256 users per step with 50
Zipf(1.05) ids each (102,400 ids per feature and step; `tpurec.bench.workloads`), every id looked
up unpooled. A step is forward + backward with row-wise Adagrad applied, side by side in one run:

* tpurec: SparseCoreEmbeddingCollection on the CPU reference (preprocessing included);
* torchrec: stock TorchRec's sharded EmbeddingCollection (DistributedModelParallel, one gloo rank,
  table-wise, its `fused` kernel: FBGEMM's CPU TBE in sequence mode with EXACT_ROWWISE_ADAGRAD),
  what a TorchRec user trains an EC with on CPU.

Both contestants run with the same torch thread count.
"""

from __future__ import annotations

import contextlib

from tpurec.bench import timer, workloads

SEQ_TABLES, SEQ_ROWS, SEQ_DIM, SEQ_USERS, SEQ_LEN = 8, 100_000, 64, 256, 50


def _tables(num_tables, rows, dim):
    from torchrec.modules.embedding_configs import EmbeddingConfig

    return [
        EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]


def _backward_all(out: dict) -> None:
    import torch

    values = [jt.values() for jt in out.values()]
    torch.cat(values).backward(torch.ones(sum(v.shape[0] for v in values), values[0].shape[1]))


def _tpurec(num_tables, rows, dim):
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

    m = SparseCoreEmbeddingCollection(
        _tables(num_tables, rows, dim), RowWiseAdagrad, {"lr": 0.01, "eps": 1e-8}, num_sparsecores=4, device="cpu"
    )
    return lambda kjt: _backward_all(m(kjt))


def _torchrec(num_tables, rows, dim):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ec = EmbeddingCollection(tables=_tables(num_tables, rows, dim), device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.01, "eps": 1e-8})
    sharder = EmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        ec,
        per_param_sharding={f"t{i}": table_wise(rank=0, compute_kernel="fused") for i in range(num_tables)},
        local_size=1,
        world_size=1,
        device_type="cpu",
        sharder=sharder,
    )
    model = DistributedModelParallel(
        ec,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    return lambda kjt: _backward_all(model(kjt))


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


def _round(batches, ids, repeats, num_tables, rows, dim) -> dict:
    """One side-by-side round: tpurec, then torchrec, each a fresh module."""
    entry = {}
    for name, factory in (("tpurec", _tpurec), ("torchrec", _torchrec)):
        step = factory(num_tables, rows, dim)
        sec = timer.median_step_seconds(step, batches, repeats)
        entry[f"{name}_step_ms"] = sec * 1e3
        entry[f"{name}_ids_per_s"] = ids / sec
        del step
    entry["ratio_vs_torchrec"] = entry["tpurec_ids_per_s"] / entry["torchrec_ids_per_s"]
    return entry


def run_sequence(
    quick: bool = False,
    num_tables=SEQ_TABLES,
    rows=SEQ_ROWS,
    dim=SEQ_DIM,
    users=SEQ_USERS,
    seq_len=SEQ_LEN,
    runs: int = 3,
) -> dict:
    """`runs` side-by-side rounds (tpurec, then torchrec, fresh modules each round); the JSON has
    every round and the median ratio."""
    import numpy as np

    rng = np.random.default_rng(0)
    keys = [f"f{i}" for i in range(num_tables)]
    batches = [
        workloads.kjt(
            workloads.fixed_pooling_ids(rng, num_tables, users, seq_len, rows, scatter_seed=workloads.SCATTER_SEED),
            keys,
        )
        for _ in range(2 if quick else 4)
    ]
    ids = num_tables * users * seq_len
    repeats = 1 if quick else 2
    rounds = []
    with _single_process_group():
        for _ in range(1 if quick else runs):
            rounds.append(_round(batches, ids, repeats, num_tables, rows, dim))
    ratios = sorted(r["ratio_vs_torchrec"] for r in rounds)
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
        "runs": rounds,
        "ratio_vs_torchrec": ratios[len(ratios) // 2],
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
    lines.append(f"median ratio vs stock TorchRec EC: {r['ratio_vs_torchrec']:.2f}x")
    return "\n".join(lines)
