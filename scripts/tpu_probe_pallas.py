"""Chip probe 5: the Pallas row kernels against the XLA programs, in JAX on the chip (no torch bridge).

For each cell (table rows x width, batch x pooling, id distribution): the pooled lookup (XLA program,
Pallas kernel at two chunk sizes) and the fused update (SGD, row-wise Adagrad: XLA program vs row
gradients + Pallas in-place add), tables donated in both. Contenders interleave in a random order per
round; results are compared once (equal work) before timing. Prints and writes JSON to $OUT/pallas.json.
Usage: python3 scripts/tpu_probe_pallas.py [--quick | --cpu]
"""

import functools
import json
import os
import random
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.embedding.constraints import round_up
from tpurec.embedding.preprocess import preprocess
from tpurec.embedding.tensorcore import pallas_programs, programs

OUT = os.environ.get("OUT", "/tmp")
CPU = "--cpu" in sys.argv  # a dry run of the script on CPU: tiny cells, kernels interpreted
QUICK = "--quick" in sys.argv or CPU
HBM_GBPS = 819.0  # v5e HBM bandwidth, cloud.google.com/tpu/docs/v5e


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


def lookup_cell(R, D, B, H, dist, out):
    head, layout, n = csr_for(R, B, H, dist, seed=R + D + H)
    table = jax.random.normal(jax.random.key(0), (R, D), jnp.float32)
    xla = jax.jit(functools.partial(programs._lookup, layout))
    cont = {"xla": lambda: xla(*head, table)}
    for chunk in (256, 1024):
        f = jax.jit(functools.partial(pallas_programs.lookup, layout, chunk=chunk, interpret=CPU))
        cont[f"pallas_c{chunk}"] = functools.partial(lambda f: f(head, table), f)
    want = np.asarray(block(cont["xla"]()))
    errs = {}
    for k in list(cont):
        if k == "xla":
            continue
        try:
            errs[k] = float(np.abs(np.asarray(block(cont[k]())) - want).max())
        except Exception as e:  # a compile failure is a reading too
            out.setdefault("errors", {})[f"lookup {k} {R}x{D} B{B} H{H} {dist}"] = traceback.format_exc()[-3000:]
            del cont[k]
            print("FAILED", k, repr(e)[:300], flush=True)
    ms = timed_rounds(cont, rounds=3 if QUICK else 5, reps=5 if QUICK else 10)
    row_bytes = n * D * 4
    cell = {
        "cell": f"lookup {R}x{D} f32 B{B} H{H} {dist}",
        "ms": ms,
        "GBps_rows": {k: row_bytes / v / 1e6 for k, v in ms.items()},
        "max_abs_err_vs_xla": errs,
    }
    best = min((v for k, v in ms.items() if k != "xla"), default=None)
    if best:
        cell["speedup_best_pallas_vs_xla"] = ms["xla"] / best
    print(json.dumps(cell), flush=True)
    out["cells"].append(cell)


def update_cell(R, D, B, H, dist, out):
    head, layout, n = csr_for(R, B, H, dist, seed=R + D + H + 1)
    grad = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
    lr, eps = jnp.float32(0.01), jnp.float32(1e-8)
    state = {}

    def fresh(k):
        state[k] = (
            jax.random.normal(jax.random.key(2), (R, D), jnp.float32),
            jnp.zeros((R,), jnp.float32),
        )

    xla_sgd = jax.jit(functools.partial(programs._sgd, layout), donate_argnums=(1,))
    pal_sgd = jax.jit(functools.partial(pallas_programs.sgd, layout, interpret=CPU), donate_argnums=(1,))
    xla_ada = jax.jit(functools.partial(programs._adagrad, layout), donate_argnums=(1, 2))
    pal_ada = jax.jit(functools.partial(pallas_programs.adagrad, layout, interpret=CPU), donate_argnums=(1, 2))
    rg = jax.jit(functools.partial(pallas_programs._row_gradients, layout))

    def run(k, kind, f):
        t, a = state[k]
        if kind == "sgd":
            state[k] = (f(head, t, grad, lr), a)
        else:
            state[k] = f(head, t, a, grad, lr, eps)
        return state[k]

    cont = {
        "xla_sgd": ("sgd", xla_sgd),
        "pallas_sgd": ("sgd", pal_sgd),
        "xla_rowwise_adagrad": ("ada", xla_ada),
        "pallas_rowwise_adagrad": ("ada", pal_ada),
    }
    errs = {}
    for k in cont:
        fresh(k)
    try:
        for k, (kind, f) in list(cont.items()):
            try:
                block(run(k, kind, f))
            except Exception as e:
                out.setdefault("errors", {})[f"update {k} {R}x{D}"] = traceback.format_exc()[-3000:]
                print("FAILED", k, repr(e)[:300], flush=True)
                del cont[k]
        for a, b in (("xla_sgd", "pallas_sgd"), ("xla_rowwise_adagrad", "pallas_rowwise_adagrad")):
            if a in cont and b in cont:
                errs[b] = [float(jnp.abs(x - y).max()) for x, y in zip(state[a], state[b])]
    except Exception:
        out.setdefault("errors", {})[f"update compare {R}x{D}"] = traceback.format_exc()[-3000:]
    calls = {k: functools.partial(run, k, *v) for k, v in cont.items()}
    calls["row_gradients_only"] = lambda: rg(head, state["xla_sgd"][0], grad)
    ms = timed_rounds(calls, rounds=3 if QUICK else 5, reps=5 if QUICK else 10)
    cell = {"cell": f"update {R}x{D} f32 B{B} H{H} {dist}", "ms": ms, "max_abs_err_vs_xla_after_1_step": errs}
    for a, b in (("xla_sgd", "pallas_sgd"), ("xla_rowwise_adagrad", "pallas_rowwise_adagrad")):
        if a in ms and b in ms:
            cell[f"speedup_{b}"] = ms[a] / ms[b]
    print(json.dumps(cell), flush=True)
    out["cells"].append(cell)


def main():
    out = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "cells": []}
    print(out["devices"], flush=True)
    random.seed(0)
    lookups = [
        (1_000_000, 128, 16384, 8, "uniform"),
        (1_000_000, 256, 16384, 8, "uniform"),
        (1_000_000, 64, 16384, 8, "uniform"),
        (1_000_000, 16, 16384, 8, "uniform"),
        (1_000_000, 128, 16384, 1, "uniform"),
        (1_000_000, 128, 4096, 32, "uniform"),
        (1_000_000, 128, 16384, 8, "zipf"),
    ]
    updates = [(1_000_000, 128, 16384, 8, "uniform"), (1_000_000, 128, 16384, 8, "zipf")]
    if QUICK:
        lookups, updates = lookups[:1], updates[:1]
    if CPU:
        lookups, updates = [(5000, 128, 64, 8, "uniform")], [(5000, 128, 64, 8, "zipf")]
    for cell in lookups:
        try:
            lookup_cell(*cell, out)
        except Exception:
            out.setdefault("errors", {})[f"lookup cell {cell}"] = traceback.format_exc()[-3000:]
            print(traceback.format_exc()[-2000:], flush=True)
        json.dump(out, open(os.path.join(OUT, "pallas.json"), "w"), indent=1)
    for cell in updates:
        try:
            update_cell(*cell, out)
        except Exception:
            out.setdefault("errors", {})[f"update cell {cell}"] = traceback.format_exc()[-3000:]
            print(traceback.format_exc()[-2000:], flush=True)
        json.dump(out, open(os.path.join(OUT, "pallas.json"), "w"), indent=1)
    print("HBM", HBM_GBPS, "errors:", list(out.get("errors", {})), flush=True)


if __name__ == "__main__":
    main()
