"""Chip probe 15: where tpurec's TensorCore lookup spends its time, and the Pallas pooling's options
(#59's lookup bar; the train step's lookups).

Why: probe 14 (session 40) put the row gather of tpurec's 131,080-slot CSR at 0.58 ms (116 GB/s at
1M x 128), yet the lookup took 1.27-1.34 ms: ~0.7 ms is the decode, the gains and the pooling, which
moves 75 MB (0.1 ms of HBM). The pooling kernel copies the gathered rows to whole 1,024-entry chunks
(`pad_values`) and adds each entry's row into its sample's output row, a read-modify-write each
entry's waits on if it may alias the previous one (`accumulators`: 2 or 4 output copies taken in turn,
folded at the end, since session 40's run; `rows_per_load`, 8 rows a load, ran then and gained
nothing, and is gone); and the MLPerf stack's lookup took 46.9 ms
for 2.13M slots in probe 10 (22 ns a slot against the bench cell's 10), against pure JAX's 29.3 ms.

Session 40's run: the padding copy went (`pad_values=False`), and 4 output copies and the gains
inside the kernel each won in every cell, measured apart. Session 41 asks how they combine, and 8.

Per cell (the bench's CSR from `tpu_kernels.inputs_for`; interleaved in a random order per round):
- `xla`: the bench's contender (`jnp.take` + `segment_sum`); `xla_pool`: tpurec's decode and gather
  pooled by XLA's segment sum;
- `lookup`: `lookup_jax.lookup` with the chip's default pooling options (`tpu_bridge.pool_options`:
  the gains inside the kernel, `pool_vmem.ACCUMULATORS` output copies);
- `lookup_a{1,4,8}[_gains]`: the lookup with that many output copies, the gains inside the kernel or
  in a pass over the gathered rows (`lookup_a1`: session 40's default);
- `decode_gather`: the decode and the gains-scaled gather alone (the pooling's input);
- `pool_only_a{1,4,8}`: the pooling alone, of `decode_gather`'s rows.
Equal work: every lookup variant's output within 1e-4 of `lookup`'s (checked once).

    python3 scripts/tpu_probe_lookup_pool.py          # on the chip: $OUT/lookup_pool.json
    python3 scripts/tpu_probe_lookup_pool.py --cpu    # a tiny cell, the kernel interpreted (tests/scripts)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CELLS = [  # (rows, width, bags, pooling, dist)
    (1_000_000, 128, 16384, 8, "uniform"),
    (1_000_000, 128, 16384, 8, "zipf"),
    (1_000_000, 16, 16384, 8, "uniform"),
    (2_000_000, 128, 16384, 100, "zipf"),  # about the MLPerf stack's 2M slots (probe 10)
]
CPU_CELLS = [(2000, 128, 32, 4, "zipf")]
LOOKUPS = {"lookup_a1": (1, False), "lookup_a1_gains": (1, True), "lookup_a4": (4, False)}
LOOKUPS |= {"lookup_a4_gains": (4, True), "lookup_a8": (8, False), "lookup_a8_gains": (8, True)}
POOL_ONLY = (1, 4, 8)  # accumulators


def programs(batch: int, num_sc: int, parts: int, rows: int, interpret: bool) -> dict[str, Any]:
    """name -> jitted program: the lookups with each pooling option, and their pieces."""
    import jax
    import jax.numpy as jnp

    from tpurec.embedding import pool_vmem
    from tpurec.embedding.tensorcore import lookup_jax, pallas_pool
    from tpurec.embedding.tensorcore.csr_jax import decode

    kw = {"device_batch_size": batch, "num_sc": num_sc, "num_partitions": parts}

    @jax.jit
    def decode_gather(rp: Any, emb: Any, smp: Any, gns: Any, t: Any) -> tuple[Any, Any]:
        e = decode(rp, emb, smp, gns, num_rows=t.shape[0], **kw)  # as lookup_jax.lookup
        return t[jnp.where(e.valid, e.rows, 0)].astype(jnp.float32) * e.gains[:, None], e.samples

    def lookup(acc: int, gains: bool) -> Any:
        opts = {"pallas_pool": True, "interpret": interpret, "pool_gains": gains, "pool_accumulators": acc}
        return jax.jit(functools.partial(lookup_jax.lookup, **kw, **opts))

    # interpreted (CPU): 128-entry chunks, the interpreter's loop a fraction of the chip's 1,024
    chunk = 128 if interpret else pallas_pool.CHUNK
    progs: dict[str, Any] = {"decode_gather": decode_gather, "lookup": lookup(pool_vmem.ACCUMULATORS, True)}
    progs["xla_pool"] = jax.jit(functools.partial(lookup_jax.lookup, **kw, pallas_pool=False))
    progs |= {name: lookup(*opts) for name, opts in LOOKUPS.items()}
    for r in POOL_ONLY:
        opts = {"accumulators": r, "chunk": chunk, "interpret": interpret}
        progs[f"pool_only_a{r}"] = jax.jit(functools.partial(pallas_pool.segment_sum, num_segments=batch, **opts))
    return progs


def run_cell(spec: tuple, rounds: int, reps: int, rng: random.Random, interpret: bool) -> dict[str, Any]:
    import numpy as np

    from tpurec.bench import tpu_kernels, tpu_kernels_programs
    from tpurec.bench.tpu_kernel_cells import Cell

    rows, width, bags, pooling, dist = spec
    cell = Cell(rows, width, bags, pooling, dist)
    g = np.random.default_rng(width + pooling)
    n = bags * pooling
    ids = ((g.zipf(1.1, n) - 1) % rows) if dist == "zipf" else g.integers(0, rows, n)
    inp = tpu_kernels.inputs_for(ids, np.repeat(np.arange(bags), pooling), bags)
    table = tpu_kernels_programs._table(cell)
    batch, num_sc, parts = inp["layout"][:3]
    progs = programs(batch, num_sc, parts, rows, interpret)
    calls = {"xla": tpu_kernels_programs.lookup_pair(cell, inp, interpret)["xla"]}
    for k, prog in progs.items():
        if not k.startswith("pool_only"):
            calls[k] = lambda prog=prog: prog(*inp["csr"], table)
    values, samples = tpu_kernels._block(progs["decode_gather"](*inp["csr"], table))
    for k, prog in progs.items():
        if k.startswith("pool_only"):
            calls[k] = lambda prog=prog: prog(values, samples)
    want = np.asarray(tpu_kernels._block(calls["lookup"]()))
    errors = {
        k: float(np.abs(np.asarray(tpu_kernels._block(calls[k]())) - want).max())
        for k in calls
        if k != "decode_gather"  # (rows and samples, not a lookup)
    }
    if max(errors.values()) > 1e-4:
        raise AssertionError(f"{spec}: outputs differ from the lookup's: {errors}")
    secs = tpu_kernels._time(calls, rounds, reps, rng)
    ms = {k: 1e3 * float(np.median(v)) for k, v in secs.items()}
    return {
        "cell": str(cell),
        "ids": n,
        "slots": int(inp["csr"][1].shape[0]),
        "ms": ms,
        "vs_xla": {k: ms["xla"] / v for k, v in ms.items() if k != "xla"},
        "max_error_vs_lookup": errors,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="a tiny cell on CPU JAX (the Pallas pooling interpreted)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "lookup_pool.json"))
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
