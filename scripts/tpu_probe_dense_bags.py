"""Chip probe 13: the pooled lookup from bag-major ids ([bags, ids a bag], padded with gain 0) against
the XLA contender of `tpurec bench tpu-kernels` and tpurec's TensorCore kernel (#59's lookup bar).

Why: on v5e XLA's row gather alone moves 114 GB/s of rows (session 28: 0.59 ms of the 1.71 ms `take` +
`segment_sum` program at 1M x 128, 16,384 x 8 ids); the segment sum is the rest. Ids laid out a bag to a
row make the pooling a reduction over a fixed axis, which XLA may fuse into the gather: if the whole
lookup then costs about the gather, that is ~2.9x the contender, the size of #59's 3x bar, and a layout
the TensorCore kernel could take on chips without SparseCores. Variable bags pad to the longest bag
(pads read row 0 with gain 0): `--var` cells draw lengths uniform in 0 .. 2 x pooling, so the padded
gather reads ~2x the rows; the cell reports the padding.

Contenders per cell (interleaved in a random order per round, `tpu_kernels._time`; equal work: every
output within 1e-4 of the contender's, checked once):
- `xla`: `tpu_kernels_programs.lookup_pair`'s plain JAX (`jnp.take` + `segment_sum` by sample);
- `tpurec`: the TensorCore kernel's lookup from its CSR (the same pair);
- `gather`: `jnp.take` of the ids alone (the floor: no pooling);
- `dense_bags`: `take` of [bags, width of the longest bag] ids, times the gains, summed over axis 1.

    python3 scripts/tpu_probe_dense_bags.py            # on the chip: $OUT/dense_bags.json
    python3 scripts/tpu_probe_dense_bags.py --cpu      # a tiny cell on CPU JAX (tests/scripts)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CELLS = [  # (rows, width, bags, pooling, dist, variable lengths)
    (1_000_000, 128, 16384, 8, "uniform", False),
    (1_000_000, 128, 16384, 8, "zipf", False),
    (1_000_000, 256, 16384, 8, "uniform", False),
    (1_000_000, 64, 16384, 8, "uniform", False),
    (1_000_000, 16, 16384, 8, "uniform", False),
    (1_000_000, 128, 16384, 1, "uniform", False),
    (1_000_000, 128, 4096, 32, "uniform", False),
    (1_000_000, 128, 16384, 8, "uniform", True),
]
CPU_CELLS = [(2000, 128, 32, 4, "zipf", True)]  # (the interpreted Pallas pooling takes seconds a call)


def bag_major(lengths: Any, ids: Any) -> tuple[Any, Any]:
    """[bags, longest] ids (0 where padded) and gains (1 for an id, 0 for a pad) from CSR lengths."""
    import numpy as np

    width = max(int(lengths.max()), 1) if lengths.size else 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    col = np.arange(width)[None, :]
    real = col < lengths[:, None]
    at = np.minimum(offsets[:-1, None] + col, max(ids.size - 1, 0))
    dense = np.where(real, ids[at] if ids.size else 0, 0).astype(np.int32)
    return dense, real.astype(np.float32)


def cell_inputs(rows: int, bags: int, pooling: int, dist: str, variable: bool, seed: int) -> dict[str, Any]:
    """The bench's inputs for these ids (`tpu_kernels.inputs_for`: CSR, ids, samples) and their
    bag-major form. Variable bags: lengths uniform in 0 .. 2 x pooling."""
    import jax.numpy as jnp
    import numpy as np

    from tpurec.bench import tpu_kernels

    g = np.random.default_rng(seed)
    lengths = g.integers(0, 2 * pooling + 1, bags) if variable else np.full(bags, pooling)
    n = int(lengths.sum())
    ids = ((g.zipf(1.1, n) - 1) % rows) if dist == "zipf" else g.integers(0, rows, n)
    dense, gains = bag_major(lengths, ids)
    inp = tpu_kernels.inputs_for(ids, np.repeat(np.arange(bags), lengths), bags)
    return inp | {"dense": jnp.asarray(dense), "gains": jnp.asarray(gains), "n": n, "padded": int(dense.size)}


def run_cell(spec: tuple, rounds: int, reps: int, rng: random.Random, interpret: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpurec.bench import tpu_kernels, tpu_kernels_programs
    from tpurec.bench.tpu_kernel_cells import Cell

    rows, width, bags, pooling, dist, variable = spec
    cell = Cell(rows, width, bags, pooling, dist)
    inp = cell_inputs(rows, bags, pooling, dist, variable, seed=width + pooling)
    calls = tpu_kernels_programs.lookup_pair(cell, inp, interpret)
    table = tpu_kernels_programs._table(cell)  # the pair's table (the same key: the same values)

    @jax.jit
    def gather(ids: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.take(t, ids, axis=0)

    @jax.jit
    def dense_bags(ids: jax.Array, gains: jax.Array, t: jax.Array) -> jax.Array:
        return (jnp.take(t, ids, axis=0).astype(jnp.float32) * gains[:, :, None]).sum(axis=1)

    calls["gather"] = lambda: gather(inp["ids"], table)
    calls["dense_bags"] = lambda: dense_bags(inp["dense"], inp["gains"], table)
    want = np.asarray(tpu_kernels._block(calls["xla"]()))
    errors = {
        k: float(np.abs(np.asarray(tpu_kernels._block(calls[k]())) - want).max()) for k in ("tpurec", "dense_bags")
    }
    if max(errors.values()) > 1e-4:
        raise AssertionError(f"{spec}: outputs differ from the XLA contender's: {errors}")
    secs = tpu_kernels._time(calls, rounds, reps, rng)
    ms = {k: 1e3 * float(np.median(v)) for k, v in secs.items()}
    return {
        "cell": f"{rows}x{width} bags {bags} pooling {pooling}{' var' if variable else ''} {dist}",
        "ids": inp["n"],
        "padded_slots": inp["padded"],
        "ms": ms,
        "vs_xla": {k: ms["xla"] / v for k, v in ms.items() if k != "xla"},
        "GBps_rows": {k: inp["n"] * width * 4 / v / 1e6 for k, v in ms.items()},
        "max_error_vs_xla": errors,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny cells on CPU JAX (the Pallas pooling interpreted)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "dense_bags.json"))
    args = p.parse_args(argv)
    import jax

    rng = random.Random(0)
    rounds, reps = (1, 1) if args.cpu else (args.rounds, args.reps)
    doc: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cells": []}
    for spec in CPU_CELLS if args.cpu else CELLS:
        doc["cells"].append(run_cell(spec, rounds, reps, rng, interpret=args.cpu))
        print(json.dumps(doc["cells"][-1]), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))  # after each cell: a timed-out run keeps them
    return doc


if __name__ == "__main__":
    main()
