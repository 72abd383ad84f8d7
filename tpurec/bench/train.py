"""`tpurec bench train`: DLRM training throughput, tpurec's DMP vs stock TorchRec's, side by side.

Same model (dlrm-tiny: DLRM, 26 tables <= 1,000 x 16, RowWiseAdagrad fused into backward, Adagrad
MLPs), same synthetic data, same per-rank batch, same TrainPipelineSparseDist loop, N ranks over
gloo with one thread each. The two sides differ only in the sharding stack:

* tpurec: `tpurec.DistributedModelParallel` (tpurec planner, SparseCore sharder; its CPU reference
  kernel here);
* torchrec: torchrec's own DistributedModelParallel with the FBGEMM `fused` kernel, tables placed
  table-wise round-robin (stock TorchRec on CPU refuses row-wise sharding).

Batches are read into memory before timing, so the reader is not part of the figure. Each side runs
in its own `torch.distributed.run` job; the samples/s figure counts the timed steps only (after
warm-up), across all ranks. The sides take turns `--repeats` times (`tpurec.bench.timer.interleaved`):
each round runs all three side by side, the JSON keeps every round (`rounds`), the figures are
medians over rounds (ratios: the median of the rounds' ratios), with the load average at start
and end. The data are `tpurec.data.synth`'s (a continuous-approximation Zipf law; see
`tpurec.bench.workloads`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from tpurec.bench import timer

TABLE_MODULE = "model.sparse_arch.embedding_bag_collection"
# tpurec: its planner's plan (what `tpurec train` runs); tpurec-tw: tpurec's kernel on the stock
# side's table-wise placement (isolates kernel + sharder from the plan); torchrec: stock, FBGEMM fused.
SIDES = ("torchrec", "tpurec", "tpurec-tw")


def register(sub) -> None:
    p = sub.add_parser("train", help="DLRM training throughput: tpurec DMP vs stock TorchRec DMP (FBGEMM fused)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per side (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps first (default 30)")
    p.add_argument("--batch-size", type=int, default=512, help="batch per rank (default 512)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="side-by-side rounds, medians reported (default 3; the host is shared)",
    )
    p.set_defaults(run=run_cli)


def run_cli(args) -> int:
    for name in ("nproc", "steps", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            print(f"tpurec bench train: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from tpurec.dlrm.data import synth_cache_problem

    problem = synth_cache_problem("dlrm-tiny", _rows(args.nproc, args.steps, args.warmup, args.batch_size), 0)
    if problem:  # the data is made first, then minutes of timed runs
        print(f"tpurec bench train: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run(
            nproc=args.nproc, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, repeats=args.repeats
        )
    except RuntimeError as e:
        print(f"tpurec bench train: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def _rows(nproc: int, steps: int, warmup: int, batch_size: int) -> int:
    """Rows of the synthetic dataset the benchmark trains on (every rank's steps, 10% to spare)."""
    return max(100_000, int((steps + warmup) * batch_size * nproc * 1.1) + 1)


def run(nproc: int = 2, steps: int = 300, warmup: int = 30, batch_size: int = 512, repeats: int = 3) -> dict:
    from tpurec.dlrm.data import ensure_synth

    data = ensure_synth(
        "dlrm-tiny", _rows(nproc, steps, warmup, batch_size), 0, say=lambda m: print(m, file=sys.stderr)
    )
    load_start = round(os.getloadavg()[0], 2)
    # Each launch reports its own timed region; the parent's clock would include process start-up.
    runs = timer.interleaved(
        [lambda side=side: launch(side, data, nproc, steps, warmup, batch_size) for side in SIDES],
        warmup=0,
        repeats=repeats,
    )
    rounds = [
        {side: r.results[k] for side, r in zip(SIDES, runs)} for k in range(repeats)
    ]  # round k: every side's k-th run, side by side
    for rd in rounds:
        rd["ratio_vs_torchrec"] = round(rd["tpurec"]["samples_per_s"] / rd["torchrec"]["samples_per_s"], 3)
        rd["ratio_table_wise_vs_torchrec"] = round(
            rd["tpurec-tw"]["samples_per_s"] / rd["torchrec"]["samples_per_s"], 3
        )

    def median(side, key):
        return statistics.median(rd[side][key] for rd in rounds)

    last = rounds[-1]
    return {
        "model": "dlrm-tiny",
        "nproc": nproc,
        "batch_size_per_rank": batch_size,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "threads_per_rank": 1,
        "tpurec_samples_per_s": median("tpurec", "samples_per_s"),
        "torchrec_samples_per_s": median("torchrec", "samples_per_s"),
        "ratio_vs_torchrec": statistics.median(rd["ratio_vs_torchrec"] for rd in rounds),
        "tpurec_cpu_samples_per_s": median("tpurec", "cpu_samples_per_s"),
        "torchrec_cpu_samples_per_s": median("torchrec", "cpu_samples_per_s"),
        "ratio_vs_torchrec_cpu": statistics.median(
            round(rd["tpurec"]["cpu_samples_per_s"] / rd["torchrec"]["cpu_samples_per_s"], 3) for rd in rounds
        ),
        "tpurec_table_wise_samples_per_s": median("tpurec-tw", "samples_per_s"),
        "ratio_table_wise_vs_torchrec": statistics.median(rd["ratio_table_wise_vs_torchrec"] for rd in rounds),
        "rounds": rounds,
        "tpurec_plan": last["tpurec"]["plan"],
        "torchrec_plan": last["torchrec"]["plan"],
        "tpurec_final_loss": last["tpurec"]["loss"],
        "torchrec_final_loss": last["torchrec"]["loss"],
        "load_average_1min": [load_start, round(os.getloadavg()[0], 2)],
    }


def torchrun_json(module: str, nproc: int, args: list[str], what: str) -> dict:
    """`python -m module args` on `nproc` ranks under torchrun, one thread each; the JSON line rank 0
    printed last. A failed launch raises RuntimeError naming `what`, with the tail of its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", module, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def launch(side, data, nproc, steps, warmup, batch_size) -> dict:
    """One side's training run under torchrun; its JSON line."""
    args = ["--side", side, "--data", str(data), "--steps", str(steps), "--warmup", str(warmup)]
    return torchrun_json("tpurec.bench.train", nproc, [*args, "--batch-size", str(batch_size)], f"{side} side")


def format_table(r: dict) -> str:
    return "\n".join(
        [
            f"DLRM training throughput: {r['model']}, {r['nproc']} ranks x 1 thread, "
            f"batch {r['batch_size_per_rank']}/rank, "
            f"{r['steps']} timed steps (medians of {r['repeats']} side-by-side rounds; "
            f"load average {r['load_average_1min'][0]} at start, {r['load_average_1min'][1]} at end)",
            f"  tpurec DMP (tpurec planner, SparseCore CPU reference)  {r['tpurec_samples_per_s']:>12,.0f} samples/s",
            f"  stock TorchRec DMP (FBGEMM fused, table-wise)          {r['torchrec_samples_per_s']:>12,.0f} samples/s",
            f"  tpurec DMP on the stock side's table-wise plan         "
            f"{r['tpurec_table_wise_samples_per_s']:>12,.0f} samples/s",
            f"  ratio_vs_torchrec (planner's plan)                     {r['ratio_vs_torchrec']:>12.3f}",
            f"  ratio_table_wise_vs_torchrec                           {r['ratio_table_wise_vs_torchrec']:>12.3f}",
            f"  per CPU-second: tpurec {r['tpurec_cpu_samples_per_s']:,.0f}, "
            f"torchrec {r['torchrec_cpu_samples_per_s']:,.0f}, "
            f"ratio {r['ratio_vs_torchrec_cpu']:.3f}",
            f"  plans: tpurec {r['tpurec_plan']}; torchrec {r['torchrec_plan']}",
        ]
    )


# ----- one rank of one side (run by torch.distributed.run) -------------------------------------------
def table_wise_plan(model, world: int, stock: bool):
    """Tables placed whole, round-robin over ranks; FBGEMM's fused kernel (stock) or tpurec's."""
    import dataclasses

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from tpurec.sharding.kernel_choice import COMPUTE_KERNEL
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    ebc = model.model.sparse_arch.embedding_bag_collection
    names = [c.name for c in ebc.embedding_bag_configs()]
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={n: table_wise(rank=i % world) for i, n in enumerate(names)},
        local_size=world,
        world_size=world,
        device_type="cpu",
        sharder=EmbeddingBagCollectionSharder() if stock else SparseCoreEBCSharder(num_sparsecores=4),
    )
    kernel = "fused" if stock else COMPUTE_KERNEL
    plan = {n: dataclasses.replace(ps, compute_kernel=kernel) for n, ps in plan.items()}
    return ShardingPlan({TABLE_MODULE: plan})


def _plan_text(dmp) -> str:
    kinds = {}
    for mp in dmp.plan.plan.values():
        for ps in mp.values():
            key = f"{ps.sharding_type}/{ps.compute_kernel}"
            kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def worker(side: str, data: str, steps: int, warmup: int, batch_size: int) -> dict | None:
    import itertools

    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tpurec.data.reader import ParquetReader
    from tpurec.dlrm.configs import get_config, override
    from tpurec.dlrm.model import build_model, build_optimizer, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = override(get_config("dlrm-tiny"), batch_size=batch_size)
    torch.manual_seed(0)
    model = build_model(cfg)
    plan = table_wise_plan(model, world, stock=side == "torchrec") if side != "tpurec" else None
    dmp = shard(model, cfg, "cpu", plan=plan, stock=side == "torchrec")
    optimizer = build_optimizer(dmp, cfg)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    reader = ParquetReader(data, batch_size, rank=rank, world_size=world, drop_last=True, equal_rows=True)
    batches = list(itertools.islice(iter(reader), warmup + steps))
    if len(batches) < warmup + steps:
        raise RuntimeError(f"{data} holds only {len(batches)} batches per rank")
    it = iter(batches)
    for _ in range(warmup):
        pipeline.progress(it)
    dist.barrier()
    with timer.Stopwatch() as wall:  # until every rank is done
        with timer.Stopwatch() as mine:  # this rank's CPU time, barrier wait excluded
            for _ in range(steps):  # the pipeline drains its in-flight batches once the list runs out
                loss = pipeline.progress(it)[0]
        dist.barrier()
    cpu = torch.tensor([mine.cpu], dtype=torch.float64)
    seconds = wall.wall
    dist.all_reduce(cpu)  # CPU-seconds of all ranks: steadier than wall time on a busy host
    samples = steps * batch_size * world
    out = {
        "side": side,
        "samples_per_s": round(samples / seconds, 1),
        "seconds": round(seconds, 3),
        "cpu_samples_per_s": round(samples / cpu.item(), 1),
        "loss": round(float(loss), 5),
        "plan": _plan_text(dmp),
    }
    dist.destroy_process_group()
    return out if rank == 0 else None


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.train", description="one rank of tpurec bench train")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=512)
    a = p.parse_args(argv)
    out = worker(a.side, a.data, a.steps, a.warmup, a.batch_size)
    if out is not None:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
