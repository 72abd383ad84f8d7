"""`tpurec bench tpu-kernels`: the TensorCore kernel's lookup and fused updates against plain JAX, on a TPU.

Each cell (table rows x width x dtype, batch x pooling, uniform or Zipf ids) runs, in JAX on the chip:
- `tpurec`: the kernel's own programs on tpurec's CSR input (decode, gather, the Pallas pooling where
  it fits; row gradients without a sort (merged by the Pallas kernel where it fits), then the optimizer
  on the distinct rows);
- `xla`: what a JAX user writes on the same ids: `jnp.take` + `segment_sum` for the lookup, and for the
  updates `.at[ids].add` (SGD) or a dense gradient (row-wise Adagrad), jitted with donated tables.
Contenders interleave in a random order per round (seed reported); equal work is checked once (same
outputs within float32 rounding); every cell reports rows' bytes per second, the ratio to `xla` per
round, the median and worst round; the run reports the worst and median cell and the share of HBM
bandwidth. `--cpu`: a smoke run on CPU (tiny cells, the Pallas kernel interpreted), for CI.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tpurec import strict_json
from tpurec.bench.rounds import fresh_seed, load_average, ratio_summary
from tpurec.bench.tpu_kernel_cells import CHIP_CELLS, CPU_CELLS, Cell
from tpurec.runtime.device import DeviceKind

# v5e HBM bandwidth, 819 GB/s: cloud.google.com/tpu/docs/v5e (the chip this benchmark was written on)
HBM_GBPS = {"v5e": 819.0}


OPS = ("lookup", "sgd", "rowwise_adagrad")


def _inputs(cell: Cell, seed: int) -> dict[str, Any]:
    """Ids, samples (sample-major bags) and tpurec's CSR for the cell, on the default JAX device."""
    import numpy as np

    g = np.random.default_rng(seed)
    ids = (g.zipf(1.1, cell.ids) - 1) % cell.rows if cell.dist == "zipf" else g.integers(0, cell.rows, cell.ids)
    return inputs_for(ids, np.repeat(np.arange(cell.batch), cell.pooling), cell.batch)


def inputs_for(ids: Any, samples: Any, batch: int) -> dict[str, Any]:
    """`_inputs`' dict for given int64 ids and their samples (numpy, sample-major), on the default JAX device."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from tpurec.embedding.constraints import round_up
    from tpurec.embedding.preprocess import preprocess

    csr, _ = preprocess(
        torch.from_numpy(ids),
        torch.from_numpy(samples),
        torch.ones(ids.size),
        device_batch_size=batch,
        num_sc_per_device=1,
        global_device_count=1,
        max_ids_per_partition=round_up(ids.size + 8, 8),
    )
    head = tuple(jnp.asarray(t.numpy()) for t in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains))
    return {
        "ids": jnp.asarray(ids.astype(np.int32)),
        "samples": jnp.asarray(samples.astype(np.int32)),
        "csr": head,
        "layout": (csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions, csr.max_unique_ids_per_partition),
    }


def _block(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def _contenders(op: str, cell: Cell, inp: dict[str, Any], interpret: bool) -> dict[str, Callable[[], Any]]:
    """name -> a call running the op once (updates carry their donated table from call to call)."""
    from tpurec.bench import tpu_kernels_programs as P

    make = {"lookup": P.lookup_pair, "sgd": P.sgd_pair, "rowwise_adagrad": P.rowwise_adagrad_pair}[op]
    return make(cell, inp, interpret)


def _time(calls: dict[str, Callable[[], Any]], rounds: int, reps: int, rng: random.Random) -> dict[str, list[float]]:
    secs: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        order = list(calls)
        rng.shuffle(order)
        for k in order:
            _block(calls[k]())  # warm, and the pipeline drained
            t0 = time.perf_counter()
            for _ in range(reps):
                r = calls[k]()
            _block(r)
            secs[k].append((time.perf_counter() - t0) / reps)
    return secs


def run_cell(
    op: str, cell: Cell, inp: dict[str, Any], rounds: int, reps: int, rng: random.Random, interpret: bool
) -> dict:
    from tpurec.bench import tpu_kernels_programs as P

    calls = _contenders(op, cell, inp, interpret)
    equal = P.equal_work(op, calls)
    secs = _time(calls, rounds, reps, rng)
    row_bytes = cell.ids * cell.width * (2 if cell.dtype == "bfloat16" else 4)
    med = {k: statistics.median(v) for k, v in secs.items()}
    return {
        "op": op,
        "cell": str(cell),
        "ms": {k: round(v * 1e3, 4) for k, v in med.items()},
        "GBps_rows": {k: round(row_bytes / v / 1e9, 2) for k, v in med.items()},
        "vs_xla": ratio_summary(secs["tpurec"], secs["xla"]),
        "equal_work_max_abs_diff": equal,
    }


def summary(results: list[dict], hbm_gbps: float | None) -> dict:
    out: dict[str, Any] = {}
    for op in OPS:
        cells = [r for r in results if r["op"] == op]
        if not cells:
            continue
        ratios = [r["vs_xla"]["ratio"] for r in cells]
        worst = min(cells, key=lambda r: r["vs_xla"]["ratio"])
        best_gbps = max(r["GBps_rows"]["tpurec"] for r in cells)
        out[op] = {
            "median_cell_ratio": round(statistics.median(ratios), 3),
            "worst_cell": worst["cell"],
            "worst_cell_ratio": round(worst["vs_xla"]["ratio"], 3),
            "worst_round_ratio": round(min(r["vs_xla"]["min"] for r in cells), 3),
            "best_GBps_rows": best_gbps,
            "best_share_of_hbm": round(best_gbps / hbm_gbps, 4) if hbm_gbps else None,
        }
    return out


def _pick_cells(cells: list[Cell], spec: str | None) -> list[Cell]:
    from tpurec.errors import UserError

    if spec is None:
        return cells
    try:
        picked = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--cells takes cell numbers like 0,2,5 (see --list-cells); got {spec!r}") from None
    bad = [i for i in picked if not 0 <= i < len(cells)]
    if bad or not picked:
        raise UserError(f"--cells: numbers in 0..{len(cells) - 1} (see --list-cells); got {spec!r}")
    return [cells[i] for i in picked]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tpu-kernels", help="the TensorCore kernel vs plain JAX on a TPU (--cpu: a smoke run)")
    p.add_argument("--cpu", action="store_true", help="tiny cells on CPU, the Pallas kernel interpreted (CI)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset (default {','.join(OPS)})")
    p.add_argument("--cells", default=None, help="comma-separated cell numbers (0-based; default: all; --list-cells)")
    p.add_argument("--list-cells", action="store_true", help="print the cells with their numbers and exit")
    p.add_argument("--rounds", type=int, default=5, help="rounds per cell (default 5)")
    p.add_argument("--reps", type=int, default=10, help="calls timed per round (default 10)")
    p.add_argument("--seed", type=int, default=None, help="order and data seed (default: fresh, reported)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from tpurec.errors import UserError

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UserError(f"--ops takes {', '.join(OPS)}; got {', '.join(bad)}")
    all_cells = CPU_CELLS if args.cpu else CHIP_CELLS
    if args.list_cells:
        for i, c in enumerate(all_cells):
            print(f"{i}  {c}")
        return 0
    cells = _pick_cells(all_cells, args.cells)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    platform = jax.default_backend()
    if platform != DeviceKind.TPU and not args.cpu:
        raise UserError(f"JAX sees no TPU here (its backend: {platform}); run on a TPU VM, or --cpu for a smoke run")
    seed = fresh_seed() if args.seed is None else args.seed
    rng = random.Random(seed)
    rounds, reps = (2, 1) if args.cpu else (args.rounds, args.reps)
    load_before = load_average()
    results = []
    t0 = time.perf_counter()
    for cell in cells:
        inp = _inputs(cell, seed=rng.randrange(2**31))  # once per cell: every op sees the same ids
        for op in ops:
            r = run_cell(op, cell, inp, rounds, reps, rng, interpret=args.cpu)
            results.append(r)
            # progress on stderr whatever the output: a cell compiles two programs per op (seconds each)
            ratio = r["vs_xla"]["ratio"]
            print(f"[{time.perf_counter() - t0:6.1f} s] {op:16s} {cell}: {ratio:.3f}x xla", file=sys.stderr, flush=True)
            if not args.json:
                print(strict_json.dumps(r), flush=True)
    kind = str(jax.devices()[0].device_kind)
    hbm = HBM_GBPS["v5e"] if "v5 lite" in kind.lower() or "v5e" in kind.lower() else None  # JAX: "TPU v5 lite"
    doc = {
        "device": kind,
        "jax": jax.__version__,
        "seed": seed,
        "load_average": {"before": load_before, "after": load_average()},
        "summary": summary(results, hbm),
        "cells": results,
    }
    print(strict_json.dumps(doc if args.json else {k: v for k, v in doc.items() if k != "cells"}, indent=1))
    return 0
