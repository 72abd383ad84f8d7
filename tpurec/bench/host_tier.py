"""`tpurec bench host-tier`: a table on the host tier against the same table resident, on the CPU or a TPU.

One EmbeddingBagCollection table (ROWS x DIM, row-wise Adagrad) and a linear head, trained on the same
batches by every contender: `resident` (all rows in the kernel: on a TPU, in HBM) and `host-<load
factor>` (the table in host memory behind a cache of that share of its rows, LRU or LFU; on a TPU the
cache is in HBM and rows cross the host link in fixed-shape copies, docs/host_tier.md). Ids are
Zipf(1.05) over the rows (hot rows scattered by a fixed permutation) or uniform. Every contender first
trains `--warmup` steps on batches of their own, not timed (a TPU compiles its programs there); then
per round the contenders run in a random order, each STEPS steps on that round's batches, timed up to
a drain of the device (tpurec/bench/host_tier_steps.py). Reported: samples/s, the ratio to `resident`
per round (median, worst), the cache's hit rate after the first round (distinct rows per batch found
cached), evictions, rows loaded and written back a step and the write-back's device->host copies a
step. Equal work: every contender's losses equal the resident one's, on the CPU bit for bit at every
step (the tier is exact there), on a TPU within a relative 1e-5 over the warm-up and the first round
(a bag's rows are summed in slot order there: docs/host_tier.md, "What is exact").

`--device cpu` (default): host memory and "device" memory are one memory, so the figures are the
tier's bookkeeping and host-to-host copies. `--device tpu`: the module and the head on the chip (or,
with `--emulate-tpu SLICE`, on tpurec's emulated TPU: the TPU code path on this CPU, CI's smoke run of
it; no figure of a chip). `--quick` is CI's smoke shape.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

from tpurec import strict_json
from tpurec.argtypes import nonnegative_int, positive_int
from tpurec.bench.rounds import fresh_seed, load_average, ratio_summary
from tpurec.errors import UserError

FULL = {"rows": 200_000, "dim": 64, "batch": 512, "pooling": 8, "steps": 20, "rounds": 3}  # docs/bench.md
QUICK = {"rows": 10_000, "dim": 16, "batch": 64, "pooling": 4, "steps": 4, "rounds": 3}
# --device tpu: one 4,000,000 x 128 float32 table, 1.91 GiB (+ 15 MiB of row-wise Adagrad state). On a
# v5e's 15.7 GiB the resident contender holds it twice for a moment (the TensorCore kernel's update
# returns a new table, copied back: 3.8 GiB), the four default caches (0.05 + 0.1 + 0.2 + 0.5 of the
# rows) 1.6 GiB more and the largest one's update copy 0.95 GiB: about 6.4 GiB with every contender
# alive at once, under half the chip. Host memory: each host-tier contender keeps the whole table and
# its state, 4 x 1.93 GiB of the TPU VM's 40 GiB. Batch 16,384 x 8 = 131,072 ids (the kernel's chip
# probes, docs/results.md): uniform ids touch about 129,000 distinct rows a batch
# (4M x (1 - e^(-131,072 / 4M))), within the smallest cache's 200,000 rows (a batch over its cache is
# refused); 2M rows would not hold them at 0.05. 3 rounds x 20 steps and a warm-up of 3: 315 steps a
# law, most of them the host tier's (docs/bench.md has the run's expected time).
CHIP = {"rows": 4_000_000, "dim": 128, "batch": 16_384, "pooling": 8, "steps": 20, "rounds": 3}
PINNED_SUFFIX = "-pinned"  # --pinned: a host contender's twin whose loads stage in pinned memory
TPU_LOSS_RTOL = 1e-5  # equal work on a TPU: the largest relative loss difference to resident allowed


@contextlib.contextmanager
def _staging_for(name: str) -> Iterator[None]:
    """A `-pinned` contender's loads stage in pinned host memory (TPUREC_HOST_TIER_PINNED), the others'
    in pageable memory: set around each of its calls, so the two interleave in one run."""
    from tpurec.embedding.host_tier.device_copies import PINNED_ENV

    before = os.environ.pop(PINNED_ENV, None)
    if name.endswith(PINNED_SUFFIX):
        os.environ[PINNED_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(PINNED_ENV, None)
        if before is not None:
            os.environ[PINNED_ENV] = before


def run_dist(shape: dict, dist: str, load_factors: list[float], algorithm: str, rng: random.Random, env: dict) -> dict:
    """Every contender on one id law: the warm-up, then the interleaved rounds; their figures."""
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    from tpurec.bench import host_tier_steps as s

    device = env["torch_device"]
    # the warm-up's batches and each round's, the same for every contender (one sees round 0, 1, ... in turn)
    warm_data = s.batches(shape, dist, env["warmup"], rng.randrange(2**31), device)
    data = [s.batches(shape, dist, shape["steps"], rng.randrange(2**31), device) for _ in range(shape["rounds"])]
    _check_caches(shape, dist, [warm_data, *data], min(load_factors))
    algo = CacheAlgorithm.LFU if algorithm == "lfu" else CacheAlgorithm.LRU
    caches = {"resident": None, **{f"host-{lf:g}": CacheParams(load_factor=lf, algorithm=algo) for lf in load_factors}}
    if env.get("pinned"):  # each host contender again, its loads staged in pinned memory
        caches.update({f"{k}{PINNED_SUFFIX}": c for k, c in caches.items() if c is not None})
    models, first, setup = {}, {}, {}
    for name, cache in caches.items():  # built, then warmed up (a TPU compiles here): not timed
        t0 = time.perf_counter()
        models[name] = s.model(shape, cache, device)
        t1 = time.perf_counter()
        with _staging_for(name):
            first[name] = s.train(models[name], warm_data)[0] if warm_data else []
        setup[name] = {"build_s": round(t1 - t0, 2), "warmup_s": round(time.perf_counter() - t1, 2)}
        if env["progress"]:
            print(strict_json.dumps({"dist": dist, "contender": name, **setup[name]}), flush=True)
    in_use = _device_bytes(device)
    secs: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    copies = dict.fromkeys(models, 0)
    warm: dict[str, dict[str, Any] | None] = {}
    for r in range(shape["rounds"]):
        order = list(models)
        rng.shuffle(order)
        for name in order:
            with _staging_for(name):
                got, seconds, made = s.train(models[name], data[r])
            secs[name].append(seconds)
            losses[name] += got
            if r == 0:
                first[name] += got
                warm[name] = s.counters(models[name])  # the cold cache's first round, left out of the hit rate
            else:
                copies[name] += made
            if env["progress"]:
                line = {"dist": dist, "round": r + 1, "contender": name, "seconds": round(seconds, 4)}
                print(strict_json.dumps(line), flush=True)
    expected = s.planner_hit_rates(shape, [warm_data, *data], load_factors, algorithm)
    samples, later = shape["steps"] * shape["batch"], shape["steps"] * (shape["rounds"] - 1)
    out: dict[str, Any] = {"dist": dist, "device_bytes_in_use": in_use, "contenders": {}}
    for name, m in models.items():
        diff = s.max_rel_diff(first[name], first["resident"])
        exact = losses[name] == losses["resident"] and first[name] == first["resident"]
        out["contenders"][name] = {
            "samples_per_s": round(samples / min(secs[name]), 1),
            "samples_per_s_median": round(samples / statistics.median(secs[name]), 1),
            "vs_resident": ratio_summary(secs[name], secs["resident"]),
            "losses_equal_resident": exact if env["bit_exact"] else diff <= TPU_LOSS_RTOL,
            "loss_max_rel_diff_round_1": diff,
            "cache": _with_planner(
                s.steady(warm[name], s.counters(m), later, copies[name]), expected.get(name.removesuffix(PINNED_SUFFIX))
            ),
            "kernel_device": str(m["ebc"].kernel.stack_weight(0).device),
            **setup[name],
        }
    models.clear()
    gc.collect()  # the next law's models take the chip's memory: these go first
    return out


def _with_planner(cache: dict[str, Any] | None, expected: float | None) -> dict[str, Any] | None:
    """The cache's figures with the planner's expected hit rate beside the measured one, and whether
    the cache was full while measured (it evicted): the planner's figure is a full cache's."""
    if cache is None or expected is None:
        return cache
    measured = cache["hit_rate_after_round_1"]
    return {
        **cache,
        "planner_hit_rate": expected,
        "measured_minus_planner_points": round(100 * (measured - expected), 2),
        "cache_full": cache["evictions"] > 0,
    }


def _check_caches(shape: dict, dist: str, data: list[list], load_factor: float) -> None:
    """Refuse, before any model is built, a smallest cache that cannot hold a batch's distinct rows
    (the kernel would refuse that batch in the middle of the run)."""
    import numpy as np

    rows = max(1, math.ceil(round(load_factor * shape["rows"], 6)))
    most = max((np.unique(kjt.values().numpy()).size for part in data for kjt, _ in part), default=0)
    if most > rows:
        raise UserError(
            f"--load-factors {load_factor:g}: a cache of {rows:,} of {shape['rows']:,} rows, but a {dist} batch "
            f"touches {most:,} distinct rows; give load factors of at least {most / shape['rows']:.3g}, more "
            "--rows or a smaller --batch"
        )


def _device_bytes(device: Any) -> int | None:
    from tpurec.bench.tpu_train_split import _device_bytes as in_use

    return in_use(device)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "host-tier", help="a table on the host tier vs resident, on the CPU or a TPU (hit rate, samples/s)"
    )
    p.add_argument(
        "--load-factors",
        default="0.05,0.1,0.2,0.5",
        help="cache sizes as shares of the rows (default 0.05,0.1,0.2,0.5)",
    )
    p.add_argument("--algorithm", choices=("lru", "lfu"), default="lru", help="eviction (default lru)")
    p.add_argument("--dists", default="zipf,uniform", help="id laws: zipf (exponent 1.05), uniform (default both)")
    p.add_argument(
        "--device",
        choices=("cpu", "tpu"),
        default=None,
        help="cpu (default): tiers in one memory; tpu: the module and head on the chip, caches in HBM",
    )
    p.add_argument(
        "--emulate-tpu",
        metavar="SLICE",
        default=None,
        help="--device tpu on tpurec's emulated TPU (e.g. v5e-1) on this CPU: the TPU path's smoke run (docs/tpu.md)",
    )
    p.add_argument(
        "--pinned",
        action="store_true",
        help="each host-tier contender twice: its loads staged in pageable and in pinned host memory "
        "(TPUREC_HOST_TIER_PINNED; a TPU's pinned allocator, else pageable with a warning)",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes (CI's smoke run)")
    p.add_argument("--rows", type=positive_int, default=None, help="table rows (default 200,000; tpu 4,000,000)")
    p.add_argument("--dim", type=positive_int, default=None, help="table width (default 64; tpu 128)")
    p.add_argument("--batch", type=positive_int, default=None, help="samples a batch (default 512; tpu 16,384)")
    p.add_argument("--pooling", type=positive_int, default=None, help="ids a sample (default 8)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps a round (default 20)")
    p.add_argument("--rounds", type=positive_int, default=None, help="rounds (default 3)")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps first, each contender (default 3)")
    p.add_argument("--seed", type=int, default=None, help="order and data seed (default: fresh, reported)")
    p.add_argument("--json", action="store_true", help="print one JSON document (no line per round)")
    p.set_defaults(run=run)


def _parse(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    try:
        load_factors = [float(x) for x in args.load_factors.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--load-factors takes numbers like 0.1,0.2; got {args.load_factors!r}") from None
    if not load_factors or not all(0 < lf < 1 for lf in load_factors):
        raise UserError(f"--load-factors: shares of the rows in (0, 1); got {args.load_factors!r}")
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    if not dists or set(dists) - {"zipf", "uniform"}:
        raise UserError(f"--dists takes zipf, uniform; got {args.dists!r}")
    return load_factors, dists


def _shape(args: argparse.Namespace, tpu: bool) -> dict:
    """The shape of the flags: --quick's, or the device's default, each flag given over it."""
    shape = dict(QUICK if args.quick else CHIP if tpu else FULL)
    shape.update({k: getattr(args, k) for k in shape if getattr(args, k) is not None})
    return shape


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    """The device the bench trains on and what the report says of it."""
    import torch

    if args.emulate_tpu is not None and args.device == "cpu":
        raise UserError("--emulate-tpu runs the TPU path; --device cpu contradicts it")
    if args.emulate_tpu is None and args.device in (None, "cpu"):
        return {"device": "cpu", "torch_device": torch.device("cpu"), "bit_exact": True}
    from tpurec.embedding.backend import select_device
    from tpurec.runtime import device as dev

    if args.emulate_tpu is not None:
        from tpurec.emulation.rank import activate

        try:
            activate(args.emulate_tpu)
        except UserError as e:
            raise UserError(f"--emulate-tpu: {e}") from None
    elif not (dev.tpu_status().usable or dev.emulated_slice()):
        missing = dev.tpu_status().missing(cpu="--device cpu")
        raise UserError("--device tpu: this host cannot run TPU kernels: " + "; ".join(missing))
    env = {
        "device": "tpu",
        "torch_device": select_device("tpu"),
        "chip": dev.tpu_generation(),
        "emulated": dev.emulated_slice(),
        "kernels": "tensorcore" if dev.tensorcore_only() else "sparsecore",
        "bit_exact": False,
        # the head's matmul in full float32 (a TPU's default rounds its inputs to bfloat16), so that the
        # tiers' losses differ by the bags' summation order alone
        "matmul_precision": "highest",
    }
    torch.set_float32_matmul_precision("highest")
    return env


def run(args: argparse.Namespace) -> int:
    load_factors, dists = _parse(args)
    env = _environment(args)
    shape = _shape(args, env["device"] == "tpu")
    env.update(warmup=args.warmup, progress=not args.json, pinned=args.pinned)
    seed = fresh_seed() if args.seed is None else args.seed
    rng = random.Random(seed)
    before = load_average()
    results = [run_dist(shape, d, load_factors, args.algorithm, rng, env) for d in dists]
    doc = {
        **{k: v for k, v in env.items() if k not in ("torch_device", "progress", "bit_exact")},
        "shape": shape,
        "algorithm": args.algorithm,
        "equal_work": "bit for bit, every step"
        if env["bit_exact"]
        else f"relative {TPU_LOSS_RTOL:g}, warm-up and round 1",
        "seed": seed,
        "load_average": {"before": before, "after": load_average()},
        "results": results,
    }
    print(strict_json.dumps(doc, indent=1))
    return 0 if all(c["losses_equal_resident"] for r in results for c in r["contenders"].values()) else 1
