"""One rank of `tpurec bench plan --calibrate`: several plans of dlrm-tiny trained in one launch, in turns.

Separate launches per plan measured the same plan at 15-25 ms per step within minutes on this
shared host (docs/planner.md, runs 1-5): launch-to-launch drift was larger than most differences
between plans. Here every rank builds one DistributedModelParallel per plan (the same seeded model,
the same batches) and the plans take turns in blocks of a few steps: turn t runs every plan's block
once, in an order rotated by t // 2 (reversed on odd turns), so each plan's blocks sit seconds from every
other plan's, and load from other jobs falls on all of them alike. A block starts with one untimed
step (the caches the previous plan's tables warmed belong to another model) and is timed between
two barriers; the JSON line (rank 0) holds every block's wall and CPU ms per step, per plan.

Run by torch.distributed.run: `python -m tpurec.bench.calibrate_worker --data D --plans P1,P2,...`.
"""

from __future__ import annotations

from collections.abc import Iterator

from tpurec import strict_json
from tpurec.bench import timer
from tpurec.runtime.device import DeviceKind


def turn_order(n: int, turn: int) -> list[int]:
    """Plan indices of turn `turn`: rotated by turn // 2, reversed on odd turns (so over 2n turns
    every plan runs in every place; rotating by the turn itself kept each place's plans to one parity)."""
    order = [(i + turn // 2) % n for i in range(n)]
    return order[::-1] if turn % 2 else order


def worker(data: str, plan_files: list[str], turns: int, block: int, warmup: int, batch_size: int) -> dict | None:
    import gc
    import itertools

    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tpurec.data.reader import ParquetReader
    from tpurec.dlrm.configs import get_config, override
    from tpurec.dlrm.model import build_model, build_optimizer, shard
    from tpurec.planner.plan_io import load_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = override(get_config("dlrm-tiny"), batch_size=batch_size)
    reader = ParquetReader(data, batch_size, rank=rank, world_size=world, drop_last=True, equal_rows=True)
    # Enough distinct batches for one plan's whole run; every plan cycles through the same ones.
    batches = list(itertools.islice(iter(reader), warmup + turns * (block + 1)))
    pipelines: list[tuple[TrainPipelineSparseDist, Iterator]] = []
    for path in plan_files:
        torch.manual_seed(0)
        dmp = shard(build_model(cfg), cfg, DeviceKind.CPU, plan=load_plan(path))
        pipelines.append(
            (TrainPipelineSparseDist(dmp, build_optimizer(dmp, cfg), torch.device("cpu")), itertools.cycle(batches))
        )
    for pipeline, it in pipelines:
        for _ in range(warmup):
            pipeline.progress(it)
    wall: list[list[float]] = [[] for _ in plan_files]
    cpu: list[list[float]] = [[] for _ in plan_files]
    for turn in range(turns):
        for i in turn_order(len(plan_files), turn):
            pipeline, it = pipelines[i]
            pipeline.progress(it)  # untimed: back to this plan's tables
            # Python's collector runs when allocations say so, and one pass inside a block would be
            # charged to whichever plan was running: it is off during blocks and catches up after
            # (a gc.collect() per block made the launch 2.7x longer: a full pass over 12 models).
            gc.disable()
            dist.barrier()
            with timer.Stopwatch() as w:  # until every rank is done
                with timer.Stopwatch() as mine:  # this rank's CPU time, barrier wait excluded
                    for _ in range(block):
                        pipeline.progress(it)
                dist.barrier()
            gc.enable()
            wall[i].append(1e3 * w.wall / block)
            cpu[i].append(1e3 * mine.cpu / block)
    # CPU ms per step of all ranks (the work, which other jobs disturb less than the wall clock)
    cpu_all = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(cpu_all)
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "wall_ms": [[round(x, 4) for x in v] for v in wall],
        "cpu_ms": [[round(x, 4) for x in v] for v in cpu_all.tolist()],
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.calibrate_worker", description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--plans", required=True, help="plan files, comma-separated")
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--block", type=int, default=8, help="timed steps per plan per turn")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=512)
    a = p.parse_args(argv)
    out = worker(a.data, a.plans.split(","), a.turns, a.block, a.warmup, a.batch_size)
    if out is not None:
        print(strict_json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from tpurec.runtime.rank_exit import run_and_exit

    run_and_exit(main)  # not through the interpreter's teardown: gloo can abort it (rank_exit.py)
