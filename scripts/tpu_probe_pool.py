"""Chip probe 7: the pooled lookup as XLA's gather + a Pallas pooling kernel (output in VMEM), against
the XLA program; and the TensorCore update's row gradients taken apart (decode, grad rows, segment sum,
unique rows). One cell per width (1M rows, batch 16,384 x pooling 8, uniform; width 128 also Zipf).
Contenders interleave in a random order per round; outputs compared to the program's once.
Writes $OUT/pool.json. Usage: python3 scripts/tpu_probe_pool.py [--cpu]
(Probes 5-6, the DMA-per-row Pallas kernels that measured slower than XLA, are in commit e2c05c3.)
"""

import functools
import json
import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.embedding.constraints import round_up
from tpurec.embedding.preprocess import preprocess
from tpurec.embedding.tensorcore import pallas_pool, programs
from tpurec.embedding.tensorcore.csr_jax import decode

CPU = "--cpu" in sys.argv
OUT = os.environ.get("OUT", "/tmp")


def csr_for(rows: int, batch: int, pooling: int, dist: str, seed: int):
    g = np.random.default_rng(seed)
    n = batch * pooling
    if dist == "zipf":
        ids = (g.zipf(1.1, n) - 1) % rows
    else:
        ids = g.integers(0, rows, n)
    samples = np.repeat(np.arange(batch), pooling)
    csr, _ = preprocess(
        torch.from_numpy(ids),
        torch.from_numpy(samples),
        torch.ones(n),
        device_batch_size=batch,
        num_sc_per_device=1,
        global_device_count=1,
        max_ids_per_partition=round_up(n + 8, 8),
    )
    head = tuple(jnp.asarray(t.numpy()) for t in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains))
    return head, (csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions), n


def block(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)
    return x


def timed_rounds(contenders: dict, rounds: int, reps: int) -> dict:
    """contenders: name -> zero-arg callable (runs one op, returns arrays). Median ms per op per name."""
    times = {k: [] for k in contenders}
    for _ in range(rounds):
        order = list(contenders)
        random.shuffle(order)
        for k in order:
            f = contenders[k]
            block(f())
            t0 = time.perf_counter()
            for _ in range(reps):
                r = f()
            block(r)
            times[k].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def run_cells(cells: list, cell_fn, name: str) -> None:
    """Run cell_fn(*cell) for each cell, print each result as a JSON line and keep them all (after
    each cell, so a timed-out run keeps what it measured) in $OUT/<name>.json."""
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cells": []}
    for c in cells:
        r = cell_fn(*c)
        print(json.dumps(r), flush=True)
        out["cells"].append(r)
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(out, f, indent=1)


def lookup_cell(R, D, B, H, dist, out):
    head, layout, n = csr_for(R, B, H, dist, seed=D + H)
    table = jax.random.normal(jax.random.key(0), (R, D), jnp.float32)

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def gather_pool(csr, t, chunk, unroll):
        e = decode(*csr, num_rows=R, device_batch_size=B, num_sc=1, num_partitions=layout[2])
        v = t[jnp.where(e.valid, e.rows, 0)] * e.gains[:, None]
        return pallas_pool.segment_sum(v, e.samples, num_segments=B, chunk=chunk, unroll=unroll, interpret=CPU)

    xla = jax.jit(functools.partial(programs._lookup, layout))
    cont = {"xla_program": lambda: xla(*head, table)}
    for chunk, unroll in ((512, 8), (1024, 8), (2048, 16)):
        cont[f"gather_pallas_pool_c{chunk}_u{unroll}"] = functools.partial(gather_pool, head, table, chunk, unroll)
    want = np.asarray(block(cont["xla_program"]()))
    errs = {k: float(np.abs(np.asarray(block(f())) - want).max()) for k, f in cont.items()}
    ms = timed_rounds(cont, rounds=5, reps=10)
    cell = {
        "cell": f"lookup {R}x{D} f32 B{B} H{H} {dist}",
        "ms": ms,
        "err": errs,
        "GBps_rows": {k: n * D * 4 / v / 1e6 for k, v in ms.items()},
    }
    print(json.dumps(cell), flush=True)
    out["cells"].append(cell)


def update_parts(R, D, B, H, out):
    head, layout, n = csr_for(R, B, H, "uniform", seed=3)
    grad = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)

    @jax.jit
    def dec(csr):
        e = decode(*csr, num_rows=R, device_batch_size=B, num_sc=1, num_partitions=layout[2])
        return e.rows, e.samples, e.gains, e.valid

    rows, samples, gains, valid = block(dec(head))
    before = jnp.concatenate([jnp.full(1, -1, jnp.int32), rows[:-1]])
    starts = valid & (rows != before)
    segment = block(jnp.cumsum(starts.astype(jnp.int32)) - 1)
    contributions = block(jnp.where(valid[:, None], grad[jnp.where(valid, samples, 0)] * gains[:, None], 0.0))

    @jax.jit
    def seg_sorted(c, s):
        return jax.ops.segment_sum(c, s, num_segments=n, indices_are_sorted=True)

    @jax.jit
    def seg_unsorted(c, s):
        return jax.ops.segment_sum(c, s, num_segments=n)

    @jax.jit
    def unique_rows(r, st, s):
        return jnp.full(n, R, jnp.int32).at[jnp.where(st, s, n)].set(r, mode="drop")

    @jax.jit
    def contrib(csr):
        rr, ss, gg, vv = dec(csr)
        return jnp.where(vv[:, None], grad[jnp.where(vv, ss, 0)] * gg[:, None], 0.0)

    cont = {
        "decode": lambda: dec(head),
        "contributions": lambda: contrib(head),
        "segment_sum_sorted": lambda: seg_sorted(contributions, segment),
        "segment_sum_unsorted_hint": lambda: seg_unsorted(contributions, segment),
        "unique_rows_scatter": lambda: unique_rows(rows, starts, segment),
    }
    ms = timed_rounds(cont, rounds=5, reps=10)
    cell = {"cell": f"row_gradients parts {R}x{D} B{B} H{H}", "ms": ms, "unique_rows": int(starts.sum())}
    print(json.dumps(cell), flush=True)
    out["cells"].append(cell)


def main():
    out = {"jax": jax.__version__, "cells": []}
    cells = [
        (1_000_000, 128, 16384, 8, "uniform"),
        (1_000_000, 256, 16384, 8, "uniform"),
        (1_000_000, 64, 16384, 8, "uniform"),
        (1_000_000, 128, 16384, 8, "zipf"),
        (1_000_000, 128, 16384, 1, "uniform"),
        (1_000_000, 128, 4096, 32, "uniform"),
    ]
    if CPU:
        cells = [(5000, 128, 64, 8, "uniform")]
    for c in cells:
        lookup_cell(*c, out)
        json.dump(out, open(os.path.join(OUT, "pool.json"), "w"), indent=1)
    update_parts(*((5000, 128, 64, 8) if CPU else (1_000_000, 128, 16384, 8)), out)
    json.dump(out, open(os.path.join(OUT, "pool.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
