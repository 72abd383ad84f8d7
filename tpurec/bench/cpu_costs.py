"""Micro-measurements of the terms of the CPU cost model (`tpurec.planner.cpu_cost`).

`tpurec bench plan --calibrate` runs these before training its plans and records them next to the
constants the model uses, so a reader can see whether this host still agrees with them:

* `kernel_terms`: one thread, `SparseCoreKernel` forward + fused row-wise Adagrad backward over
  T tables of one dim, batch B; the median time of each shape, and a least-squares split into a
  fixed cost per kernel call and a cost per id of `a + b * dim` (the reference gathers and scatters
  one row per id, so the per-id term grows with the row's width);
* `collective_terms`: two gloo processes (a FileStore, so no port is taken) timing
  `all_to_all_single` on a small message (its latency) and on a 1 MiB one (the bytes per second
  beyond the latency), and `reduce_scatter_single` / `all_gather_single` over 1 MiB (what
  row-wise sharding's pooled output and its gradient run on);
* `parallel_terms`: the same kernel call alone and in two processes at once: how many ranks the
  host runs in parallel right now (other jobs share its cores).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from tpurec import strict_json
from tpurec.runtime import safe_path

KERNEL_SHAPES = ((1, 1024, 16), (13, 1024, 16), (26, 1024, 16), (26, 512, 16), (26, 1024, 8), (13, 1024, 8))
SMALL_BYTES = 64
LARGE_BYTES = 1 << 20


def _kernel_call(tables: int, batch: int, dim: int):
    """One forward + fused backward of a fresh kernel over `tables` tables of `batch` ids each."""
    import torch
    from torchrec import KeyedJaggedTensor

    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.registry import spec_class

    spec = spec_class("rowwise_adagrad").from_hyperparameters(lr=0.1, eps=1e-8)
    kernel = SparseCoreKernel([KernelTable(f"t{i}", 1000, dim, (f"f{i}",)) for i in range(tables)], spec, 4)
    g = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(tables)],
        values=torch.randint(0, 1000, (tables * batch,), generator=g),
        lengths=torch.ones(tables * batch, dtype=torch.long),
    )
    return lambda: kernel(kjt).sum().backward()


def _kernel_once_ms(tables: int, batch: int, dim: int, reps: int) -> float:
    return _interleaved_ms([(tables, batch, dim)], reps)[0]


def _interleaved_ms(shapes, reps: int) -> list[float]:
    """Median ms per call of each shape, the shapes taking turns call by call (so a change in the
    host's speed falls on all of them, not on whichever shape was running; 13 x 1024 once measured
    slower than 26 x 1024 when each shape ran its calls in a row)."""
    calls = [_kernel_call(*shape) for shape in shapes]
    times: list[list[float]] = [[] for _ in shapes]
    for i in range(reps + 3):  # 3 untimed rounds first
        for call, out in zip(calls, times):
            t = time.perf_counter()
            call()
            if i >= 3:
                out.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e3 for ts in times]


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares x of A x = y."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()


def kernel_terms(shapes=KERNEL_SHAPES, reps: int = 30) -> dict:
    """Median ms of each (tables, batch, dim) shape and the fit fixed_ms + ids * (a_us + b_us * dim)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = [(*shape, ms) for shape, ms in zip(shapes, _interleaved_ms(shapes, reps))]
    finally:
        torch.set_num_threads(threads)
    fixed, per_id, per_float = _least_squares(
        [[1.0, t * b * 1e-3, t * b * d * 1e-3] for t, b, d, _ in measured], [ms for *_, ms in measured]
    )
    return {
        "shapes": [{"tables": t, "batch": b, "dim": d, "ms": round(ms, 3)} for t, b, d, ms in measured],
        "kernel_fixed_ms": round(fixed, 4),
        "per_id_us": round(per_id, 5),
        "per_id_float_us": round(per_float, 6),
    }


def _collective_worker(rank: int, world: int, store_path: str, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)

    def median_ms(call) -> float:
        times = []
        for i in range(reps + 5):
            dist.barrier()
            t = time.perf_counter()
            call()
            if i >= 5:
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out: dict[int | str, float] = {}  # by message bytes (all-to-all), or by collective
    for nbytes in (SMALL_BYTES, LARGE_BYTES):
        x = torch.zeros(max(world, nbytes // 4 // world * world), dtype=torch.float32)  # splits evenly
        y = torch.empty_like(x)
        out[nbytes] = median_ms(lambda x=x, y=y: dist.all_to_all_single(y, x))
    # The whole buffer is 1 MiB on every rank (reduce-scatter's input, all-gather's output).
    whole = torch.zeros(LARGE_BYTES // 4 // world * world, dtype=torch.float32)
    part = torch.empty(whole.numel() // world, dtype=torch.float32)
    out["reduce_scatter"] = median_ms(lambda: dist.reduce_scatter_single(part, whole))
    out["all_gather"] = median_ms(lambda: dist.all_gather_single(whole, part))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def collective_terms(world: int = 2, reps: int = 50) -> dict:
    """Median ms of one gloo all_to_all_single of 64 B and of 1 MiB per rank: latency and bandwidth."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with safe_path.spawning(), tempfile.TemporaryDirectory() as tmp:  # no code from the working directory
        queue = ctx.Queue()
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_collective_worker, args=(r, world, store, reps, queue)) for r in range(world)]
        for p in procs:
            p.start()
        out = queue.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    small, large = out[SMALL_BYTES], out[LARGE_BYTES]
    # The bytes that leave a rank: (world-1)/world of its buffer, for all three collectives.
    moved = LARGE_BYTES * (world - 1) / world

    def per_s(ms: float) -> int:
        return round(moved / max(ms - small, 1e-6) * 1e3)

    return {
        "world": world,
        "small_ms": round(small, 4),
        "large_ms": round(large, 4),
        "reduce_scatter_ms": round(out["reduce_scatter"], 4),
        "all_gather_ms": round(out["all_gather"], 4),
        "collective_latency_ms": round(small, 4),
        "gloo_bytes_per_s": per_s(large),
        "reduce_scatter_bytes_per_s": per_s(out["reduce_scatter"]),
        "all_gather_bytes_per_s": per_s(out["all_gather"]),
    }


def _parallel_worker(shape: tuple[int, int, int], reps: int, ready, start, queue) -> None:
    import torch

    torch.set_num_threads(1)
    _kernel_once_ms(*shape, 1)  # imports and first-call costs before the common start
    ready.put(True)
    start.wait()
    queue.put(_kernel_once_ms(*shape, reps))


def parallel_terms(ranks: int = 2, shape: tuple[int, int, int] = (26, 1024, 16), reps: int = 20) -> dict:
    """How many of `ranks` processes run at once on this host now: the kernel's median time alone
    (in this process, before and after; the lower) against `ranks` copies started together.
    `parallel_ranks` = ranks * alone / together, in [1, ranks]: 2 on an idle 2-core host, towards 1
    when other jobs take the cores."""
    import torch.multiprocessing as mp

    alone = _kernel_once_ms(*shape, reps)
    ctx = mp.get_context("spawn")
    with safe_path.spawning():  # no code from the working directory in the workers
        queue, ready, start = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_parallel_worker, args=(shape, reps, ready, start, queue)) for _ in range(ranks)]
        for p in procs:
            p.start()
    for _ in procs:
        ready.get(timeout=300)
    start.set()
    together = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    # Alone again after: a load spike during one lone run made "together" look faster than "alone",
    # so the lone figure is the better of the two.
    alone = min(alone, _kernel_once_ms(*shape, reps))
    slowest = max(together)
    return {
        "alone_ms": round(alone, 3),
        "together_ms": [round(t, 3) for t in together],
        "parallel_ranks": round(min(ranks, max(1.0, ranks * alone / slowest)), 3),
    }


def measure() -> dict:
    return {
        "kernel": kernel_terms(),
        "collective": collective_terms(),
        "parallel": parallel_terms(),
        "load_average_1min": os.getloadavg()[0],
    }


if __name__ == "__main__":
    print(strict_json.dumps(measure(), indent=2))
