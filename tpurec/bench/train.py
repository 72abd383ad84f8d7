"""`tpurec bench train`: DLRM training throughput, tpurec's DMP vs stock TorchRec's, side by side.

Workloads (`--tables`):

* `kaggle-1m` (default): the Criteo Kaggle cardinalities capped at CAP_ROWS = 1,000,000 rows per
  table (5.57 M rows in all; the cap keeps both libraries' tables, 1.4 GB at dim 64, on this 24 GB
  host), dim 64, DLRM-DCNv2 (3 low-rank cross layers of rank 64, bottom MLP 256-64, top 512-256-1),
  row-wise Adagrad fused into backward, Adagrad MLPs, batch 1024 per rank. The data are
  `tpurec.data.synth`'s for the uncapped criteo-kaggle tables, each id folded into its capped
  table (id mod rows) when the batches are read;
* `tiny`: dlrm-tiny (DLRM, 26 tables <= 1,000 x 16, batch 512): it measures the wrappers more than
  the kernels.

Same model, same synthetic data, same per-rank batch, same TrainPipelineSparseDist loop, N ranks
over gloo with one thread each. The sides differ only in the sharding stack and the plan:

* `torchrec-tw` and `tpurec-tw`: the SAME plan, tables placed whole round-robin over the ranks;
  stock TorchRec's DMP with FBGEMM's `fused` kernel, tpurec's DMP with its SparseCore kernel
  (CPU reference). Their ratio (`ratio_vs_torchrec`) compares kernels and sharders;
* `torchrec` and `tpurec`: each on its own planner's plan: TorchRec's EmbeddingShardingPlanner
  (CPU topology; table-wise or column-wise, since stock TorchRec's CPU path refuses row-wise), and
  tpurec's planner (what `tpurec train` runs). Their ratio is `ratio_own_plans_vs_torchrec`.

Batches are read into memory before timing, so the reader is not part of the figure. Each side runs
in its own `torch.distributed.run` job; the samples/s figure counts the timed steps only (after
warm-up), across all ranks. Equal work is checked once: every side reports the count and the sum
of the ids and labels it trained on, which must agree (else the run is refused). The sides take
turns `--repeats` times in a fresh random order each round (`tpurec.bench.timer.interleaved`); the
JSON keeps every round, the median ratio over rounds with the worst and best round, and the load
average at start and end. Every side starts from the same tables: each rank writes its shards of
tables drawn once per table from a fixed seed (TorchRec's default init, uniform +-sqrt(1/rows)) into
the sharded model's `state_dict()`, and the checksum of what it wrote is checked equal on every side
(the dense layers come from the same torch seed). So the sides learn alike, and their final losses
are compared: `loss_spread` is the largest difference between two sides' final losses.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
from typing import cast

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench import rounds, timer
from tpurec.runtime import safe_path
from tpurec.runtime.device import DeviceKind

TABLE_MODULE = "model.sparse_arch.embedding_bag_collection"
SIDES = ("torchrec-tw", "tpurec-tw", "torchrec", "tpurec")
CAP_ROWS = 1_000_000  # rows per table of the kaggle-1m workload (see the module docstring)
# workload -> (model config, table set's row cap, config overrides, batch per rank, steps, warm-up)
WORKLOADS = {
    "kaggle-1m": (
        "criteo-kaggle",
        CAP_ROWS,
        {
            "interaction": "dcn",
            "embedding_dim": 64,
            "dense_arch": (256, 64),
            "over_arch": (512, 256, 1),
            "dcn_num_layers": 3,
            "dcn_low_rank_dim": 64,
        },
        1024,
        50,
        5,
    ),
    "tiny": ("dlrm-tiny", None, {}, 512, 300, 30),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="DLRM training throughput: tpurec DMP vs stock TorchRec DMP (FBGEMM fused)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--tables",
        choices=tuple(WORKLOADS),
        default="kaggle-1m",
        help="kaggle-1m: Criteo Kaggle tables capped at 1M rows, dim 64, DLRM-DCNv2 (default); tiny: dlrm-tiny",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per side (default 50; tiny 300)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; tiny 30)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="batch per rank (default 1024; tiny 512)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds, each side once per round in random order; medians reported (default 3)",
    )
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    _, _, _, batch, steps, warmup = WORKLOADS[args.tables]
    args.batch_size = args.batch_size or batch
    args.steps = args.steps or steps
    args.warmup = args.warmup if args.warmup is not None else warmup
    for name in ("nproc", "steps", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            print(f"tpurec bench train: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from tpurec.dlrm.data import synth_cache_problem

    problem = synth_cache_problem(
        get_table_set_name(args.tables), _rows(args.nproc, args.steps, args.warmup, args.batch_size), 0
    )
    if problem:  # the data is made first, then minutes of timed runs
        print(f"tpurec bench train: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run(
            tables=args.tables,
            nproc=args.nproc,
            steps=args.steps,
            warmup=args.warmup,
            batch_size=args.batch_size,
            repeats=args.repeats,
        )
    except RuntimeError as e:
        print(f"tpurec bench train: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(strict_json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def get_table_set_name(tables: str) -> str:
    from tpurec.dlrm.configs import get_config

    return get_config(WORKLOADS[tables][0]).table_set


def _rows(nproc: int, steps: int, warmup: int, batch_size: int) -> int:
    """Rows of the synthetic dataset the benchmark trains on (every rank's steps, 10% to spare)."""
    return max(100_000, int((steps + warmup) * batch_size * nproc * 1.1) + 1)


def _ratios(rounds_: list[dict], ours: str, theirs: str, key: str = "samples_per_s") -> dict:
    """Per-round ratio ours/theirs of a throughput (seconds ratio theirs/ours), median, min, max."""
    return rounds.ratio_summary([1 / rd[ours][key] for rd in rounds_], [1 / rd[theirs][key] for rd in rounds_])


def run(
    tables: str = "kaggle-1m",
    nproc: int = 2,
    steps: int = 100,
    warmup: int = 10,
    batch_size: int = 1024,
    repeats: int = 3,
    sides=SIDES,
    order_seed: int | None = None,
) -> dict:
    from tpurec.dlrm.data import ensure_synth

    data = ensure_synth(
        get_table_set_name(tables),
        _rows(nproc, steps, warmup, batch_size),
        0,
        say=lambda m: print(m, file=sys.stderr),
    )
    order_seed = rounds.fresh_seed() if order_seed is None else order_seed
    load_start = rounds.load_average()
    orders: list = []
    # Each launch reports its own timed region; the parent's clock would include process start-up.
    runs = timer.interleaved(
        [functools.partial(launch, side, tables, data, nproc, steps, warmup, batch_size) for side in sides],
        warmup=0,
        repeats=repeats,
        orders=orders,
        seed=order_seed,
    )
    rounds_ = [{side: r.results[k] for side, r in zip(sides, runs)} for k in range(repeats)]
    # Equal work: every side trained on the same ids and labels (count and sums over all ranks).
    inputs = {side: rd[side]["inputs"] for rd in rounds_ for side in sides}
    if len({tuple(v) for v in inputs.values()}) != 1:
        raise RuntimeError(f"unequal work: the sides trained on different inputs {inputs}")
    # Equal start: every side's tables were the same draws (checksums of what each rank wrote).
    # Float64 sums over shards cut differently: equal to rounding, not bit for bit.
    starts = {side: rd[side]["start_tables"] for rd in rounds_ for side in sides}
    first = starts[sides[0]]
    if not all(math.isclose(a, b, rel_tol=1e-9) for v in starts.values() for a, b in zip(v, first)):
        raise RuntimeError(f"unequal start: the sides' starting tables differ {starts}")
    for rd, order in zip(rounds_, orders):
        rd["order"] = [sides[i] for i in order]

    def median(side, key):
        return statistics.median(rd[side][key] for rd in rounds_)

    out = {
        "tables": tables,
        "workload": _describe(tables),
        "nproc": nproc,
        "batch_size_per_rank": batch_size,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "order_seed": order_seed,
        "threads_per_rank": 1,
        "rounds": rounds_,
        "load_average": {"start": load_start, "end": rounds.load_average()},
        "inputs_checked": list(inputs[sides[0]]),
        "start_tables_checked": list(starts[sides[0]]),
    }
    for side in sides:
        out[f"{side}_samples_per_s"] = median(side, "samples_per_s")
        out[f"{side}_plan"] = rounds_[-1][side]["plan"]
        out[f"{side}_final_loss"] = rounds_[-1][side]["loss"]
    for name, ours, theirs in (("ratio_vs_torchrec", "tpurec-tw", "torchrec-tw"),
                               ("ratio_own_plans_vs_torchrec", "tpurec", "torchrec")):  # fmt: skip
        if ours in sides and theirs in sides:
            r = _ratios(rounds_, ours, theirs)
            cpu = _ratios(rounds_, ours, theirs, "cpu_samples_per_s")
            out.update({name: r["ratio"], f"{name}_min": r["min"], f"{name}_max": r["max"]})
            out[f"{name}_rounds"] = r["round_ratios"]
            out[f"{name}_cpu"] = cpu["ratio"]
    losses = [float(rounds_[-1][side]["loss"]) for side in sides]
    out["loss_spread"] = round(max(losses) - min(losses), 5)
    return out


def _describe(tables: str) -> str:
    model, cap, over, *_ = WORKLOADS[tables]
    capped = f", tables capped at {cap:,} rows" if cap else ""
    return f"{model}{capped}" + (f", {over}" if over else "")


def torchrun_json(module: str, nproc: int, args: list[str], what: str) -> dict:
    """`python -m module args` on `nproc` ranks under torchrun, one thread each; the JSON line rank 0
    printed last. A failed launch raises RuntimeError naming `what`, with the tail of its stderr."""
    # The agent and its ranks start without the working directory on sys.path.
    cmd = safe_path.python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}")
    cmd += ["-m", module, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=safe_path.env(OMP_NUM_THREADS="1"))
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def launch(side, tables, data, nproc, steps, warmup, batch_size) -> dict:
    """One side's training run under torchrun; its JSON line."""
    args = ["--side", side, "--tables", tables, "--data", str(data), "--steps", str(steps), "--warmup", str(warmup)]
    return torchrun_json("tpurec.bench.train", nproc, [*args, "--batch-size", str(batch_size)], f"{side} side")


def format_table(r: dict) -> str:
    la = r["load_average"]
    lines = [
        f"DLRM training throughput: {r['workload']}; {r['nproc']} ranks x 1 thread, "
        f"batch {r['batch_size_per_rank']}/rank, {r['steps']} timed steps; medians of {r['repeats']} rounds "
        f"in random order; load average {la['start'][0]} at start, {la['end'][0]} at end",
    ]
    labels = {
        "torchrec-tw": "stock TorchRec DMP, FBGEMM fused, table-wise round-robin",
        "tpurec-tw": "tpurec DMP, SparseCore CPU reference, the same plan",
        "torchrec": "stock TorchRec DMP on TorchRec's planner's plan",
        "tpurec": "tpurec DMP on tpurec's planner's plan",
    }
    for side, label in labels.items():
        if f"{side}_samples_per_s" in r:
            lines.append(f"  {label:58s} {r[f'{side}_samples_per_s']:>10,.0f} samples/s  ({r[f'{side}_plan']})")
    for name, label in (("ratio_vs_torchrec", "same plan"), ("ratio_own_plans_vs_torchrec", "own plans")):
        if name in r:
            lines.append(
                f"  ratio, {label}: {r[name]:.3f} (worst round {r[name + '_min']:.3f}, best {r[name + '_max']:.3f}; "
                f"per CPU-second {r[name + '_cpu']:.3f})"
            )
    losses = ", ".join(f"{side} {r[f'{side}_final_loss']:.4f}" for side in SIDES if f"{side}_final_loss" in r)
    lines.append(f"  final losses from the same starting tables: {losses} (spread {r['loss_spread']:.4f})")
    return "\n".join(lines)


# ----- one rank of one side (run by torch.distributed.run) -------------------------------------------
def table_wise_plan(model, world: int, stock: bool):
    """Tables placed whole, round-robin over ranks; FBGEMM's fused kernel (stock) or tpurec's."""
    import dataclasses

    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardingPlan

    from tpurec.planner.kernel_choice import COMPUTE_KERNEL
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    ebc = model.model.sparse_arch.embedding_bag_collection
    names = [c.name for c in ebc.embedding_bag_configs()]
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={n: table_wise(rank=i % world) for i, n in enumerate(names)},
        local_size=world,
        world_size=world,
        device_type="cpu",
        # ModuleSharder is invariant in its module type: cast as TorchRec's own default sharders are
        sharder=cast(
            ModuleSharder[torch.nn.Module],
            EmbeddingBagCollectionSharder() if stock else SparseCoreEBCSharder(num_sparsecores=4),
        ),
    )
    kernel = "fused" if stock else COMPUTE_KERNEL
    by_table = EmbeddingModuleShardingPlan(
        {n: dataclasses.replace(ps, compute_kernel=kernel) for n, ps in plan.items()}
    )
    return ShardingPlan({TABLE_MODULE: by_table})


def stock_planner_plan(model, world: int, batch_size: int):
    """TorchRec's own planner on a CPU topology, FBGEMM's fused kernel, table-wise or column-wise
    (stock TorchRec's CPU path refuses row-wise sharding)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder

    ebc = model.model.sparse_arch.embedding_bag_collection
    constraints = {
        c.name: ParameterConstraints(sharding_types=["table_wise", "column_wise"], compute_kernels=["fused"])
        for c in ebc.embedding_bag_configs()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), batch_size=batch_size, constraints=constraints
    )
    sharders = [cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())]  # as TorchRec's defaults
    return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)


def _plan_text(dmp) -> str:
    kinds: dict[str, int] = {}
    for mp in dmp.plan.plan.values():
        for ps in mp.values():
            key = f"{ps.sharding_type}/{ps.compute_kernel}"
            kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def start_tables(dmp, module: str, configs: list, seed: int = 0) -> list[float]:
    """Writes every table's starting values into this rank's shards through `state_dict()` (which
    aliases the live tables on both sides): table k is drawn whole from seed + k, uniform in
    +-sqrt(1/rows) as TorchRec's default init, and each shard takes its block. Returns the checksum
    of what all ranks wrote (sum and sum of squares, float64, all-reduced), for the equal-start check."""
    import torch
    import torch.distributed as dist

    sd = dmp.state_dict()
    sums = torch.zeros(2, dtype=torch.float64)
    for k, cfg in enumerate(configs):
        key = f"{module}.embedding_bags.{cfg.name}.weight"
        target = sd[key]
        bound = (1.0 / cfg.num_embeddings) ** 0.5
        gen = torch.Generator().manual_seed(seed + k)
        full = torch.empty(cfg.num_embeddings, cfg.embedding_dim).uniform_(-bound, bound, generator=gen)
        shards = target.local_shards() if hasattr(target, "local_shards") else None
        if shards is None:  # a replicated (data-parallel) table: every rank holds it, rank 0 counts it
            target.detach().copy_(full)
            blocks = [full] if dist.get_rank() == 0 else []
        else:
            blocks = []
            for sh in shards:
                (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                block = full[r0 : r0 + nr, c0 : c0 + nc]
                sh.tensor.detach().copy_(block)
                blocks.append(block)
        for b in blocks:
            sums += torch.stack([b.double().sum(), b.double().square().sum()])
        del full
    dist.all_reduce(sums)
    return [float(v) for v in sums]


def _folded(batches: list, sizes: list[int]) -> list:
    """Each feature's ids folded into its capped table (id mod rows): the same on every side."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for b in batches:
        kjt = b.sparse_features
        mods = torch.repeat_interleave(torch.tensor(sizes), torch.tensor(kjt.length_per_key()))
        folded = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % mods, lengths=kjt.lengths())
        out.append(type(b)(dense_features=b.dense_features, sparse_features=folded, labels=b.labels))
    return out


def prepare_side(side: str, workload: tuple, data: str, batch_size: int, n_batches: int) -> tuple:
    """One rank's side of a stock-vs-tpurec DLRM run (this module's and `bench track`'s): the
    process group, the sharded model from the shared starting tables, its optimizer and pipeline,
    and `n_batches` of this rank's batches folded into the capped tables. Returns (dmp, pipeline,
    batches, inputs: count and sums of ids and labels over all ranks, start-table checksum, the
    config's learning-rate schedule: call its `set_step(t)` before step t, as `tpurec train` does)."""
    import itertools

    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tpurec.data.catalog import get_table_set
    from tpurec.data.reader import ParquetReader
    from tpurec.dlrm.configs import get_config, override
    from tpurec.dlrm.model import LRSchedule, build_model, build_optimizer, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_name, cap, overrides, *_ = workload
    cfg = override(get_config(model_name), batch_size=batch_size, **overrides)
    sizes = [
        t.num_embeddings if cap is None else min(t.num_embeddings, cap) for t in get_table_set(cfg.table_set).tables
    ]
    torch.manual_seed(0)
    model = build_model(cfg, table_sizes=sizes)
    configs = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    stock = side.startswith("torchrec")
    if side.endswith("-tw"):
        plan = table_wise_plan(model, world, stock=stock)
    elif stock:
        plan = stock_planner_plan(model, world, batch_size)
    else:
        plan = None  # tpurec's planner
    dmp = shard(model, cfg, DeviceKind.CPU, plan=plan, stock=stock)
    start = start_tables(dmp, TABLE_MODULE, configs)
    optimizer = build_optimizer(dmp, cfg)
    pipeline: TrainPipelineSparseDist = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    reader = ParquetReader(data, batch_size, rank=rank, world_size=world, drop_last=True, equal_rows=True)
    batches = list(itertools.islice(iter(reader), n_batches))
    if len(batches) < n_batches:
        raise RuntimeError(f"{data} holds only {len(batches)} batches per rank")
    if cap is not None:
        batches = _folded(batches, sizes)
    inputs = torch.tensor(
        [
            sum(int(b.sparse_features.values().numel()) for b in batches),
            sum(int(b.sparse_features.values().sum()) for b in batches),
            sum(float(b.labels.sum()) for b in batches),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(inputs)
    schedule = LRSchedule(optimizer, cfg.warmup_steps, cfg.decay_start, cfg.decay_steps)
    return dmp, pipeline, batches, [int(inputs[0]), int(inputs[1]), round(float(inputs[2]), 1)], start, schedule


def worker(side: str, tables: str, data: str, steps: int, warmup: int, batch_size: int) -> dict | None:
    import torch
    import torch.distributed as dist

    dmp, pipeline, batches, inputs, start, schedule = prepare_side(
        side, WORKLOADS[tables], data, batch_size, warmup + steps
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    it = iter(batches)
    for t in range(warmup):
        schedule.set_step(t)  # the config's warm-up (the kaggle config's logits blow up without it)
        pipeline.progress(it)
    dist.barrier()
    with timer.Stopwatch() as wall:  # until every rank is done
        with timer.Stopwatch() as mine:  # this rank's CPU time, barrier wait excluded
            for t in range(warmup, warmup + steps):  # the pipeline drains its batches once the list runs out
                schedule.set_step(t)
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
        "inputs": inputs,
        "start_tables": start,
    }
    dist.destroy_process_group()
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.train", description="one rank of tpurec bench train")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--tables", choices=tuple(WORKLOADS), default="kaggle-1m")
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=1024)
    a = p.parse_args(argv)
    out = worker(a.side, a.tables, a.data, a.steps, a.warmup, a.batch_size)
    if out is not None:
        print(strict_json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from tpurec.runtime.rank_exit import run_and_exit

    run_and_exit(main)  # not through the interpreter's teardown: gloo can abort it (rank_exit.py)
