"""Where a TensorCore update's time goes, on the chip: its pieces as JAX programs, no torch.

    python3 scripts/tpu_profile_update.py [--rows 1000000] [--dim 128] [--batch 16384] [--hot 8]

Times (mean of 20, ms): the CSR decode; the row gradients (decode, sort, merged duplicates); the whole
SGD and row-wise Adagrad programs with the table kept (what tpu_bridge runs) and with it donated; a
copy of the table (what copying the result back costs). JSON on stdout and in $OUT if set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import numpy as np
import torch

from tpurec.embedding.constraints import round_up
from tpurec.embedding.preprocess import preprocess
from tpurec.embedding.tensorcore import csr_jax, tpu_bridge, update_jax


def _time(fn, *args, n: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--hot", type=int, default=8)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    n = a.batch * a.hot
    ids = torch.randint(0, a.rows, (n,), generator=g)
    samples = torch.arange(a.batch).repeat_interleave(a.hot)
    csr, _ = preprocess(
        ids,
        samples,
        torch.ones(n),
        device_batch_size=a.batch,
        num_sc_per_device=1,
        global_device_count=1,
        max_ids_per_partition=round_up(n + 8, 8),
    )
    head = [jax.numpy.asarray(t.numpy()) for t in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)]
    table = jax.numpy.asarray(np.random.default_rng(0).standard_normal((a.rows, a.dim), dtype=np.float32))
    acc = jax.numpy.zeros((a.rows,), np.float32)
    grad = jax.numpy.asarray(np.random.default_rng(1).standard_normal((a.batch, a.dim), dtype=np.float32))
    lr, eps = jax.numpy.float32(0.01), jax.numpy.float32(1e-8)
    layout = (a.batch, 1, 1)
    decode = jax.jit(
        functools.partial(csr_jax.decode, num_rows=a.rows, device_batch_size=a.batch, num_sc=1, num_partitions=1)
    )
    rowgrad = jax.jit(lambda *h: tpu_bridge._row_gradients(*h, table, grad, layout))
    sgd = jax.jit(tpu_bridge.tc_sgd, static_argnums=(7, 8, 9))
    sgd_donated = jax.jit(tpu_bridge.tc_sgd, static_argnums=(7, 8, 9), donate_argnums=(4,))
    adagrad = jax.jit(tpu_bridge.tc_adagrad, static_argnums=(9, 10, 11))
    copy = jax.jit(lambda t: t + 0)
    out = {"rows": a.rows, "dim": a.dim, "ids": n, "distinct_ids": int(torch.unique(ids).numel())}
    out["decode_ms"] = _time(decode, *head)
    out["row_gradients_ms"] = _time(rowgrad, *head)
    out["sgd_program_ms"] = _time(sgd, *head, table, grad, lr, *layout)
    out["rowwise_adagrad_program_ms"] = _time(adagrad, *head, table, acc, grad, lr, eps, *layout)
    out["table_copy_ms"] = _time(copy, table)
    t = sgd_donated(*head, table + 0, grad, lr, *layout)  # compiled before the clock starts
    jax.block_until_ready(t)
    t0 = time.perf_counter()
    for _ in range(20):
        t = sgd_donated(*head, t, grad, lr, *layout)
    jax.block_until_ready(t)
    out["sgd_program_donated_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    rows, grads = rowgrad(*head)
    out["sgd_scatter_only_ms"] = _time(jax.jit(update_jax.sgd), table, rows, grads, lr)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_update.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
