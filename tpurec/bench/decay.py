"""`tpurec bench kernels --weight-decay`: what weight decay costs tpurec's CPU training step.

Each cell times tpurec's step with a weight decay against its undecayed twin (the same optimizer
without it), on the same tables (both built from one torch seed) and the same batches: the ratio is
decayed seconds / undecayed seconds, so 1.10 means the decay costs 10%. The decays are FBGEMM's that
tpurec takes (`tpurec/embedding/optimizers/weight_decay.py`): row-wise Adagrad with L2 and with
DECOUPLE, and Adam's decoupled (AdamW) decay, each with weight_decay 0.01. Shapes and batches are
the matrix's (`tpurec.bench.matrix`); rounds interleave the twins in a fresh random order. Equal
work is checked once per cell: one step of each on the same batch gives the same pooled outputs
(the tables are equal before it) and updates the same rows (decay acts on the batch's rows only).
The worst cell (largest ratio) and the load average are reported.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Sequence

from tpurec.bench import contenders, equal_work, rounds, timer
from tpurec.bench.matrix import QUICK_SHAPES, SHAPES, Shape, _pass, _passes_per_run, _sig, make_batches

WEIGHT_DECAY = 0.01
# variant -> (optimizer of contenders.OPTIMIZERS, its weight-decay kwargs)
VARIANTS: dict[str, tuple[str, dict]] = {
    "rowwise_adagrad_l2": ("rowwise_adagrad", {"weight_decay": WEIGHT_DECAY, "weight_decay_mode": "L2"}),
    "rowwise_adagrad_decouple": ("rowwise_adagrad", {"weight_decay": WEIGHT_DECAY, "weight_decay_mode": "DECOUPLE"}),
    "adam_decoupled": ("adam", {"weight_decay": WEIGHT_DECAY}),
}
POOLINGS: tuple = (1, 20)


def _twins(shape: Shape, variant: str) -> tuple[contenders.Side, contenders.Side]:
    import torch

    optimizer, decay = VARIANTS[variant]
    torch.manual_seed(0)
    decayed = contenders.tpurec_side(shape.tables, shape.rows, shape.dim, optimizer, decay)
    torch.manual_seed(0)
    plain = contenders.tpurec_side(shape.tables, shape.rows, shape.dim, optimizer)
    return decayed, plain


def check_equal_work(decayed: contenders.Side, plain: contenders.Side, kjt, upstream) -> dict:
    """One step of each: equal outputs (equal tables before it) and the same rows updated."""
    import torch

    before = [t.detach().clone() for t in plain.tables()]
    if any(not torch.equal(a, b) for a, b in zip(decayed.tables(), before)):
        raise equal_work.UnequalWork("the twins start from different tables")
    out_a, out_b = decayed.step(kjt, upstream), plain.step(kjt, upstream)
    if not torch.equal(out_a, out_b):
        raise equal_work.UnequalWork("pooled outputs of the twins differ on equal tables")
    changed = 0
    for a, b, t0 in zip(decayed.tables(), plain.tables(), before):
        rows_a, rows_b = (a != t0).any(dim=1), (b != t0).any(dim=1)
        if not torch.equal(rows_a, rows_b):
            raise equal_work.UnequalWork("the twins updated different rows")
        changed += int(rows_a.sum())
    return {"rows_updated": changed}


def run_cell(
    variant: str, pooling, shape_name: str, shape: Shape, *, rounds_: int, nbatches: int, order_seed: int
) -> dict:
    batches = make_batches(shape, pooling, nbatches + 1, 0)
    check_batch, batches = batches[0], batches[1:]
    upstream = equal_work.upstream_gradient(shape.batch, shape.tables * shape.dim, 0)
    decayed, plain = _twins(shape, variant)
    try:
        checked = check_equal_work(decayed, plain, check_batch, upstream)
        passes = _passes_per_run((decayed, plain), batches, upstream)
        fns = [lambda side=side: _pass(side, batches, upstream, passes) for side in (decayed, plain)]
        load = rounds.load_average()[0]
        r_decayed, r_plain = timer.interleaved(fns, warmup=1, repeats=rounds_, seed=order_seed)
    finally:
        del decayed, plain
        gc.collect()
    # ratio_summary(ours, theirs) is theirs/ours per round: plain/decayed; its inverse is the cost
    summary = rounds.ratio_summary(r_decayed.wall, r_plain.wall)
    steps = passes * len(batches)
    return {
        "variant": variant,
        "pooling": pooling,
        "shape": shape_name,
        "cost_ratio": _sig(1 / summary["ratio"]),
        "worst_round": _sig(1 / summary["min"]),
        "best_round": _sig(1 / summary["max"]),
        "decayed_step_ms": round(1e3 * r_decayed.median / steps, 3),
        "undecayed_step_ms": round(1e3 * r_plain.median / steps, 3),
        "equal_work": checked,
        "load_average_1min": load,
    }


def run(
    quick: bool = False,
    variants: Sequence[str] = tuple(VARIANTS),
    poolings=POOLINGS,
    rounds_: int | None = None,
    say: Callable[[str], None] = lambda m: None,
) -> dict:
    import torch

    shapes = QUICK_SHAPES if quick else SHAPES
    rounds_ = rounds_ or (2 if quick else 7)
    seed = rounds.fresh_seed()
    start, t0 = rounds.load_average(), time.perf_counter()
    cells = []
    combos = [(v, p, s) for s in shapes for v in variants for p in poolings]
    for k, (variant, pooling, name) in enumerate(combos):
        cell = run_cell(variant, pooling, name, shapes[name], rounds_=rounds_, nbatches=1 if quick else 2,
                        order_seed=seed + k)  # fmt: skip
        cells.append(cell)
        say(
            f"{variant:26s} {pooling!s:>4} {name:6s} {cell['cost_ratio']:.3f}x (worst round {cell['worst_round']:.3f}x)"
        )
    worst = max(cells, key=lambda c: c["cost_ratio"])
    return {
        "cells": cells,
        "worst_cost_ratio": worst["cost_ratio"],
        "worst_cell": {k: worst[k] for k in ("variant", "pooling", "shape")},
        "worst_round_cost_ratio": max(c["worst_round"] for c in cells),
        "weight_decay": WEIGHT_DECAY,
        "rounds": rounds_,
        "order_seed": seed,
        "threads": torch.get_num_threads(),
        "load_average": {"start": start, "end": rounds.load_average()},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def format_decay(r: dict) -> str:
    lines = [f"{'variant':26s} {'pool':>4} {'shape':6s} {'cost':>6} {'worst':>6} {'decayed ms':>11} {'plain ms':>9}"]
    for c in r["cells"]:
        lines.append(
            f"{c['variant']:26s} {c['pooling']!s:>4} {c['shape']:6s} {c['cost_ratio']:6.3f} {c['worst_round']:6.3f} "
            f"{c['decayed_step_ms']:11.3f} {c['undecayed_step_ms']:9.3f}"
        )
    w, la = r["worst_cell"], r["load_average"]
    lines.append(
        f"worst cell {r['worst_cost_ratio']:.3f}x ({w['variant']}, pooling {w['pooling']}, {w['shape']}); worst round "
        f"{r['worst_round_cost_ratio']:.3f}x; load average {la['start'][0]} at start, {la['end'][0]} at end"
    )
    return "\n".join(lines)
