"""`tpurec bench kernels`: a training step of the embedding layer, side by side in one run.

Workload (the issue's): 26 tables x 100k rows x dim 64, batch 2048, pooling factor 1 and 20,
Zipf(1.05) ids (`tpurec.bench.workloads.zipf_ids`: numpy's discrete law folded into the table, hot ids
scattered by a fixed permutation). A step is forward + backward with row-wise Adagrad applied:

* tpurec: SparseCoreEmbeddingBagCollection on the CPU reference, preprocessing included;
* fbgemm: FBGEMM's CPU TBE (SplitTableBatchedEmbeddingBagsCodegen, EXACT_ROWWISE_ADAGRAD);
* torch: 26 nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad (element-wise: torch has no sparse
  row-wise Adagrad), the baseline a user would write by hand.

Also measured: the machine's random-gather roofline (torch.index_select of 64-float rows from a
2.6M-row table, uniform and Zipf ids), since embedding lookups are memory-bound. All contestants
run with the same torch thread count (1 by default: FBGEMM's fused backward is single-threaded).
Per pooling factor the three take turns for several rounds (`--rounds`), so that load from other
processes on a shared host falls on all of them alike; the JSON keeps every round, the medians and
the load average.
"""

from __future__ import annotations

import json

from tpurec.argtypes import positive_int
from tpurec.bench import timer, workloads

NUM_TABLES, ROWS, DIM, BATCH = 26, 100_000, 64, 2048


def register(sub) -> None:
    p = sub.add_parser(
        "kernels", help="embedding training step: tpurec CPU reference vs FBGEMM CPU TBE vs nn.EmbeddingBag"
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (same shapes)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every contestant (default 1: FBGEMM's fused backward is single-threaded, "
        "and idle spinning threads distort timings on a shared 2-core machine)",
    )
    p.add_argument("--pooling", type=int, nargs="+", default=[1, 20], help="pooling factors to run (default 1 20)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="side-by-side rounds per pooling factor, the median reported (default 5, --quick 2)",
    )
    p.add_argument(
        "--sequence",
        action="store_true",
        help="instead: an EmbeddingCollection (unpooled) training step, tpurec vs stock TorchRec's EC "
        "(tpurec/bench/sequence.py)",
    )
    p.set_defaults(run=run_cli)


def run_cli(args) -> int:
    if args.sequence:
        import torch

        from tpurec.bench.sequence import format_sequence, run_sequence

        torch.set_num_threads(args.threads)
        result = run_sequence(quick=args.quick)
        result["threads"] = torch.get_num_threads()
        print(json.dumps(result, indent=2) if args.json else format_sequence(result))
        return 0
    result = run(quick=args.quick, threads=args.threads, poolings=args.pooling, rounds=args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def make_batches(pooling: int, count: int, seed: int = 0, num_tables=NUM_TABLES, rows=ROWS, batch=BATCH):
    """`count` KJTs of `num_tables` features, every bag `pooling` Zipf ids scattered over the table."""
    import numpy as np

    rng = np.random.default_rng(seed)
    keys = [f"f{i}" for i in range(num_tables)]
    return [
        workloads.kjt(
            workloads.fixed_pooling_ids(rng, num_tables, batch, pooling, rows, scatter_seed=workloads.SCATTER_SEED),
            keys,
        )
        for _ in range(count)
    ]


def _tpurec(num_tables, rows, dim):
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    m = SparseCoreEmbeddingBagCollection(
        tables, RowWiseAdagrad, {"lr": 0.01, "eps": 1e-8}, num_sparsecores=4, device="cpu"
    )

    def step(kjt):
        out = m(kjt).values()
        out.backward(torch.ones_like(out))

    return step


def _fbgemm(num_tables, rows, dim):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * num_tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )

    def step(kjt):
        out = tbe(kjt.values(), kjt.offsets())
        out.backward(torch.ones_like(out))

    return step


def _torch(num_tables, rows, dim):
    import torch

    bags = torch.nn.ModuleList([torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(num_tables)])
    opt = torch.optim.Adagrad(bags.parameters(), lr=0.01, eps=1e-8)

    def step(kjt):
        opt.zero_grad()
        lengths = kjt.lengths().view(num_tables, -1)
        values = kjt.values().split(lengths.sum(1).tolist())
        outs = []
        for k, bag in enumerate(bags):
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[k].cumsum(0)[:-1]])
            outs.append(bag(values[k], offsets))
        out = torch.cat(outs, 1)
        out.backward(torch.ones_like(out))
        opt.step()

    return step


def gather_roofline(repeats: int = 5, rows: int = NUM_TABLES * ROWS, n: int = 1_000_000) -> dict:
    """Rows/s of torch.index_select on a 2.6M x 64 f32 table (uniform and Zipf ids): the memory-bound ceiling."""
    import numpy as np
    import torch

    table = torch.randn(rows, DIM)
    rng = np.random.default_rng(0)
    out = {}
    for name, ids in (
        ("uniform", rng.integers(0, table.shape[0], n)),
        ("zipf", workloads.zipf_ids(rng, n, table.shape[0], scatter_seed=workloads.SCATTER_SEED)),
    ):
        idx = torch.from_numpy(ids)
        runs = timer.repeat(lambda idx=idx: table.index_select(0, idx), warmup=1, repeats=repeats)
        out[f"gather_rows_per_s_{name}"] = n / runs.median
    out["gather_gb_per_s_uniform"] = out["gather_rows_per_s_uniform"] * DIM * 4 * 2 / 1e9  # read + write
    return out


def _round(contestants: dict, batches, repeats: int, lookups: int) -> dict:
    """One side-by-side round: each contestant in turn takes one warm-up step (its tables back in
    the caches) and then `repeats` passes over the batches; its median step counts."""
    out = {}
    for name, step in contestants.items():
        sec = timer.median_step_seconds(step, batches, repeats)
        out[f"{name}_step_ms"] = sec * 1e3
        out[f"{name}_lookups_per_s"] = lookups / sec
    out["ratio_vs_fbgemm"] = out["tpurec_lookups_per_s"] / out["fbgemm_lookups_per_s"]
    out["ratio_vs_torch"] = out["tpurec_lookups_per_s"] / out["torch_lookups_per_s"]
    return out


def run(
    quick: bool = False,
    threads: int | None = None,
    poolings=(1, 20),
    num_tables=NUM_TABLES,
    rows=ROWS,
    dim=DIM,
    batch=BATCH,
    rounds: int | None = None,
) -> dict:
    """Per pooling factor, `rounds` side-by-side rounds (default 5, quick 2) with all three
    contestants' tables in memory; the figures are the medians over rounds (the ratios: the median of
    the rounds' ratios), every round is in `rounds`, and the load average is taken before and after."""
    import os
    import statistics

    import torch

    if threads:
        torch.set_num_threads(threads)
    repeats = 1 if quick else 2
    nbatches = 2 if quick else 4
    rounds = rounds or (2 if quick else 5)
    result: dict = {
        "workload": {
            "tables": num_tables,
            "rows": rows,
            "dim": dim,
            "batch": batch,
            "ids": "zipf(1.05)",
            "optimizer": "row-wise Adagrad (torch baseline: element-wise sparse Adagrad)",
        },
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min_start": round(os.getloadavg()[0], 2),
    }
    ratios = []
    for pooling in poolings:
        batches = make_batches(pooling, nbatches, num_tables=num_tables, rows=rows, batch=batch)
        lookups = num_tables * batch * pooling
        contestants = {
            name: f(num_tables, rows, dim) for name, f in (("tpurec", _tpurec), ("fbgemm", _fbgemm), ("torch", _torch))
        }
        load_before = os.getloadavg()[0]
        runs = []
        for r in range(rounds):
            # Rotate who goes first, so that no contestant always follows the same one.
            names = list(contestants)[r % 3 :] + list(contestants)[: r % 3]
            runs.append(_round({n: contestants[n] for n in names}, batches, repeats, lookups))
        del contestants
        entry = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
        entry["rounds"] = runs
        entry["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        ratios.append((entry["ratio_vs_fbgemm"], pooling))
        result[f"pooling_{pooling}"] = entry
    # Top-level figures are those of the pooling factor where tpurec does worst against FBGEMM.
    worst = min(ratios)[1]
    for key in ("tpurec_lookups_per_s", "fbgemm_lookups_per_s", "torch_lookups_per_s", "ratio_vs_fbgemm"):
        result[key] = result[f"pooling_{worst}"][key]
    result["worst_pooling"] = worst
    result["roofline"] = gather_roofline(
        repeats=2 if quick else 5, rows=num_tables * rows, n=min(1_000_000, 20 * num_tables * rows)
    )
    result["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    return result


def format_table(r: dict) -> str:
    lines = [
        f"embedding training step, {r['workload']['tables']} tables x {r['workload']['rows']} rows x dim "
        f"{r['workload']['dim']}, batch {r['workload']['batch']}, zipf(1.05), {r['threads']} torch threads",
        f"{'pooling':>8} {'tpurec M/s':>11} {'fbgemm M/s':>11} {'torch M/s':>10} {'vs fbgemm':>10} {'vs torch':>9}",
    ]
    for key, e in r.items():
        if key.startswith("pooling_"):
            lines.append(
                f"{key[8:]:>8} {e['tpurec_lookups_per_s'] / 1e6:>11.2f} "
                f"{e['fbgemm_lookups_per_s'] / 1e6:>11.2f} {e['torch_lookups_per_s'] / 1e6:>10.2f} "
                f"{e['ratio_vs_fbgemm']:>9.2f}x {e['ratio_vs_torch']:>8.2f}x"
            )
    rounds = {len(e["rounds"]) for k, e in r.items() if k.startswith("pooling_")}
    lines.append(
        f"medians of {'/'.join(map(str, sorted(rounds)))} side-by-side rounds; load average (1 min) "
        f"{r['load_average_1min_start']} at start, {r['load_average_1min_end']} at end"
    )
    rf = r["roofline"]
    lines.append(
        f"roofline: index_select {rf['gather_rows_per_s_uniform'] / 1e6:.1f} M rows/s uniform "
        f"({rf['gather_gb_per_s_uniform']:.1f} GB/s), {rf['gather_rows_per_s_zipf'] / 1e6:.1f} M rows/s zipf"
    )
    return "\n".join(lines)
