"""`tpurec bench kernels --matrix`: the embedding training step, tpurec vs its peer, cell by cell.

A cell is (optimizer, pooling, shape). Optimizers: SGD, Adagrad, row-wise Adagrad against FBGEMM's
CPU TBE with the same EXACT_* optimizer, and Adam against torch's SparseAdam (FBGEMM's CPU TBE
refuses Adam; see `tpurec.bench.contenders`). Pooling: every bag 1, 20 or 100 ids, or "var" (bag
lengths uniform in 0..40, empty bags included). Shapes (`SHAPES`): many small tables of dim 16 and a
few large tables of dim 128 with uniform ids (every lookup a cache miss), and one hot table with
Zipf(1.05) ids (a few rows take most of the updates).

Per cell: both sides are built on the same initial tables; one step on the same ids is checked for
equal work (`tpurec.bench.equal_work`: same outputs, same tables after the update), and a cell that
fails is refused (listed, never timed or summarized). Then one untimed round and `rounds` timed
rounds; in each round both sides make one pass over the cell's batches, in a fresh random order
(`timer.interleaved`). Equal torch threads on both sides (the process's). The cell's figure is
the median over rounds of peer seconds / tpurec seconds (> 1: tpurec faster), with the min and
max; the matrix's are the worst cell, the worst single round and the geometric mean over cells.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from tpurec.bench import contenders, equal_work, rounds, timer, workloads

POOLINGS: tuple = (1, 20, 100, "var")
# A timed run lasts at least this long (more passes over the batches, the same count on both
# sides): a sub-millisecond run is at the mercy of one context switch on a shared host.
MIN_RUN_SECONDS = 0.05
VAR_MAX_LEN = 40  # "var" bags: lengths uniform in 0..VAR_MAX_LEN, mean 20


@dataclass(frozen=True)
class Shape:
    tables: int
    rows: int
    dim: int
    batch: int
    zipf: bool  # Zipf(1.05) ids scattered over the table, else uniform


# Sized for a 2-core, 24 GB host: the largest cell (Adam on "large": tables, two moment tables,
# both sides) holds about 3 GB, and a full matrix takes minutes (docs/results.md has a timed run).
SHAPES: dict[str, Shape] = {
    "small": Shape(tables=64, rows=20_000, dim=16, batch=256, zipf=False),
    "large": Shape(tables=4, rows=250_000, dim=128, batch=512, zipf=False),
    "hot": Shape(tables=1, rows=1_000_000, dim=64, batch=2048, zipf=True),
}
# The workload `tpurec bench kernels` runs without --matrix (the original one).
CRITEO26 = Shape(tables=26, rows=100_000, dim=64, batch=2048, zipf=True)
QUICK_SHAPES: dict[str, Shape] = {
    "small": Shape(tables=8, rows=500, dim=16, batch=32, zipf=False),
    "large": Shape(tables=2, rows=2_000, dim=128, batch=32, zipf=False),
    "hot": Shape(tables=1, rows=5_000, dim=64, batch=64, zipf=True),
}


def cells(optimizers: Sequence[str] = tuple(contenders.OPTIMIZERS), poolings=POOLINGS, shapes=tuple(SHAPES)):
    """Every (optimizer, pooling, shape) of the matrix, in the order they run."""
    return [(o, p, s) for s in shapes for o in optimizers for p in poolings]


def make_batches(shape: Shape, pooling, count: int, seed: int) -> list:
    """`count` KJTs of the shape's features (feature k looks up table k)."""
    rng = np.random.default_rng(seed)
    keys = [f"f{i}" for i in range(shape.tables)]
    scatter = workloads.SCATTER_SEED if shape.zipf else None
    out = []
    for _ in range(count):
        if pooling == "var":
            feats = workloads.variable_pooling_ids(
                rng, shape.tables, shape.batch, VAR_MAX_LEN, shape.rows, shape.zipf, scatter_seed=scatter
            )
            out.append(workloads.jagged_kjt(feats, keys))
        elif shape.zipf:
            ids = workloads.fixed_pooling_ids(rng, shape.tables, shape.batch, pooling, shape.rows, scatter_seed=scatter)
            out.append(workloads.kjt(ids, keys))
        else:
            ids = [rng.integers(0, shape.rows, (shape.batch, pooling)) for _ in range(shape.tables)]
            out.append(workloads.kjt(ids, keys))
    return out


def _sig(x: float) -> float:
    """x to 5 significant digits (ratios span several decades on tiny shapes)."""
    return float(f"{x:.5g}")


def _pass(side, batches, upstream, passes: int = 1) -> None:
    for _ in range(passes):
        for b in batches:
            side.step(b, upstream)


def _passes_per_run(sides, batches, upstream) -> int:
    """Passes over the batches that make the faster side's run last MIN_RUN_SECONDS (one untimed
    pass of each side measures them, and warms them up)."""
    fastest = float("inf")
    for side in sides:
        with timer.Stopwatch() as sw:
            _pass(side, batches, upstream)
        fastest = min(fastest, sw.wall)
    return max(1, math.ceil(MIN_RUN_SECONDS / max(fastest, 1e-6)))


def run_cell(
    optimizer: str,
    pooling,
    shape_name: str,
    shape: Shape,
    *,
    rounds_: int,
    nbatches: int,
    seed: int = 0,
    order_seed: int = 0,
    build: Callable = contenders.build,
) -> dict:
    """One cell: build, check equal work (UnequalWork propagates), then time. Its figures. `seed`
    fixes the ids and tables' gradient, `order_seed` the contenders' order in each round."""
    batches = make_batches(shape, pooling, nbatches + 1, seed)
    check_batch, batches = batches[0], batches[1:]
    upstream = equal_work.upstream_gradient(shape.batch, shape.tables * shape.dim, seed)
    ours, theirs = build(shape.tables, shape.rows, shape.dim, optimizer)
    try:
        checked = equal_work.check(ours, theirs, check_batch, upstream)
        passes = _passes_per_run((ours, theirs), batches, upstream)
        fns = [lambda side=side: _pass(side, batches, upstream, passes) for side in (ours, theirs)]
        load_before = rounds.load_average()[0]
        orders: list = []
        r_ours, r_theirs = timer.interleaved(fns, warmup=1, repeats=rounds_, seed=order_seed, orders=orders)
        load_after = rounds.load_average()[0]
    finally:
        del ours, theirs
        gc.collect()
    summary = rounds.ratio_summary(r_ours.wall, r_theirs.wall)
    lookups = sum(int(b.values().numel()) for b in batches) / len(batches)
    names = ("tpurec", contenders.peer_of(optimizer))
    return {
        "optimizer": optimizer,
        "pooling": pooling,
        "shape": shape_name,
        "peer": contenders.peer_of(optimizer),
        "ratio_vs_fbgemm": _sig(summary["ratio"]),
        "min": _sig(summary["min"]),
        "max": _sig(summary["max"]),
        "round_ratios": summary["round_ratios"],
        "tpurec_step_ms": round(1e3 * r_ours.median / (passes * len(batches)), 3),
        "peer_step_ms": round(1e3 * r_theirs.median / (passes * len(batches)), 3),
        "steps_per_run": passes * len(batches),
        "lookups_per_step": round(lookups),
        "first_in_round": [names[o[0]] for o in orders],
        "equal_work": checked,
        "load_average_1min": [load_before, load_after],
    }


def _worst(cells_: list[dict], key: str) -> dict:
    c = min(cells_, key=lambda c: c[key])
    return {"ratio": c[key], "optimizer": c["optimizer"], "pooling": c["pooling"], "shape": c["shape"]}


def summarize(done: list[dict]) -> dict:
    """Worst cell (by median), worst single round, geometric mean: overall and per optimizer."""
    if not done:
        return {}
    out = {
        "worst_ratio_vs_fbgemm": min(c["ratio_vs_fbgemm"] for c in done),
        "worst_cell": _worst(done, "ratio_vs_fbgemm"),
        "worst_round_ratio_vs_fbgemm": min(c["min"] for c in done),
        "worst_round_cell": _worst(done, "min"),
        "geomean_ratio_vs_fbgemm": _sig(rounds.geomean([c["ratio_vs_fbgemm"] for c in done])),
    }
    out["by_optimizer"] = {
        opt: {
            "peer": contenders.peer_of(opt),
            "worst": min(c["ratio_vs_fbgemm"] for c in group),
            "geomean": _sig(rounds.geomean([c["ratio_vs_fbgemm"] for c in group])),
        }
        for opt in dict.fromkeys(c["optimizer"] for c in done)
        for group in [[c for c in done if c["optimizer"] == opt]]
    }
    return out


def run_matrix(
    *,
    quick: bool = False,
    shapes: dict[str, Shape] | None = None,
    optimizers: Sequence[str] = tuple(contenders.OPTIMIZERS),
    poolings=POOLINGS,
    rounds_: int | None = None,
    nbatches: int | None = None,
    build: Callable = contenders.build,
    say: Callable[[str], None] = lambda m: None,
    order_seed: int | None = None,
) -> dict:
    """Every cell; cells whose work differs go to `refused` (and the summary figures are left out,
    since a summary over part of the matrix could flatter). Cell k orders its rounds with seed
    order_seed + k (default: a fresh seed, reported)."""
    import fbgemm_gpu
    import torch

    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    rounds_ = rounds_ or (2 if quick else 7)
    nbatches = nbatches or (1 if quick else 2)
    order_seed = rounds.fresh_seed() if order_seed is None else order_seed
    start, t0 = rounds.load_average(), time.perf_counter()
    done, refused = [], []
    for k, (opt, pooling, name) in enumerate(cells(optimizers, poolings, tuple(shapes))):
        try:
            cell = run_cell(opt, pooling, name, shapes[name], rounds_=rounds_, nbatches=nbatches, build=build,
                            order_seed=order_seed + k)  # fmt: skip
        except equal_work.UnequalWork as e:
            refused.append({"optimizer": opt, "pooling": pooling, "shape": name, "reason": str(e)})
            say(f"{opt:16s} {pooling!s:>4} {name:6s} REFUSED: {e}")
            continue
        done.append(cell)
        say(f"{opt:16s} {pooling!s:>4} {name:6s} {cell['ratio_vs_fbgemm']:.2f}x [{cell['min']:.2f}, {cell['max']:.2f}]")
    result = {
        "cells": done,
        "refused": refused,
        **({} if refused else summarize(done)),
        "shapes": {k: asdict(v) for k, v in shapes.items()},
        "var_pooling": f"bag lengths uniform in 0..{VAR_MAX_LEN}",
        "peers": {k: v for k, v in contenders.PEERS.items()},
        "optimizers": {k: {"torch": v[0], "kwargs": v[1], "fbgemm": v[2]} for k, v in contenders.OPTIMIZERS.items()},
        "rounds": rounds_,
        "order_seed": order_seed,
        "batches_per_pass": nbatches,
        "quick": quick,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "load_average": {"start": start, "end": rounds.load_average()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return result


def format_matrix(r: dict) -> str:
    lines = [f"{'optimizer':16s} {'pool':>4} {'shape':8s} {'peer':18s} {'ratio':>6} {'min':>6} {'max':>6}"]
    for c in r["cells"]:
        lines.append(
            f"{c['optimizer']:16s} {c['pooling']!s:>4} {c['shape']:8s} {c['peer']:18s} "
            f"{c['ratio_vs_fbgemm']:>6.2f} {c['min']:>6.2f} {c['max']:>6.2f}"
        )
    for c in r["refused"]:
        lines.append(f"{c['optimizer']:16s} {c['pooling']!s:>4} {c['shape']:6s} REFUSED (unequal work): {c['reason']}")
    if r["refused"]:
        lines.append(f"{len(r['refused'])} cell(s) refused: no summary")
    elif r["cells"]:
        w, wr = r["worst_cell"], r["worst_round_cell"]
        lines.append(
            f"worst cell {r['worst_ratio_vs_fbgemm']:.2f}x ({w['optimizer']}, pooling {w['pooling']}, {w['shape']}); "
            f"worst round {r['worst_round_ratio_vs_fbgemm']:.2f}x ({wr['optimizer']}, {wr['pooling']}, {wr['shape']}); "
            f"geomean {r['geomean_ratio_vs_fbgemm']:.2f}x over {len(r['cells'])} cells"
        )
    la = r["load_average"]
    lines.append(
        f"ratio = peer seconds / tpurec seconds, median of {r['rounds']} rounds in random order; "
        f"{r['threads']} torch thread(s); load average {la['start'][0]} at start, {la['end'][0]} at end"
    )
    return "\n".join(lines)


def format_markdown(r: dict) -> str:
    """Every cell as a Markdown table (for docs/results.md), then the summary line."""
    lines = [
        "| shape | optimizer | pooling | peer | tpurec ms/step | peer ms/step | median ratio | min | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        lines.append(
            f"| {c['shape']} | {c['optimizer']} | {c['pooling']} | {c['peer']} | {c['tpurec_step_ms']:.2f} | "
            f"{c['peer_step_ms']:.2f} | {c['ratio_vs_fbgemm']:.2f} | {c['min']:.2f} | {c['max']:.2f} |"
        )
    lines.extend(["", format_matrix(r).splitlines()[-2], format_matrix(r).splitlines()[-1]])
    return "\n".join(lines)
