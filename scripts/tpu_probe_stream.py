"""Chip probe 9: the update streamed through VMEM by one Pallas kernel (pallas_stream: the table in
blocks, each block's slots merged and its rows updated in VMEM, in place) against XLA's sparse update
(update_jax: row gradients, then a gather and a scatter of the distinct rows) and plain JAX (`.at[ids]
.add` SGD; row-wise Adagrad over a dense gradient). SGD and row-wise Adagrad, tables donated.
Cells: 1M rows (a partial last block), batch 16,384 x pooling 8; widths 128 uniform and Zipf, 256.
Contenders interleave in a random order per round; tables after one step compared once.
Writes $OUT/stream.json. Usage: python3 scripts/tpu_probe_stream.py [--cpu]
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from tpu_probe_pool import csr_for, run_cells, timed_rounds  # noqa: E402

from tpurec.embedding.tensorcore import pallas_stream, update_jax  # noqa: E402
from tpurec.embedding.tensorcore.csr_jax import decode  # noqa: E402

CPU = "--cpu" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
LR, EPS = jnp.float32(0.01), jnp.float32(1e-8)


def programs(R, D, B, layout):
    kw = dict(num_rows=R, width=D, device_batch_size=B, num_sc=1, num_partitions=layout[2])
    dec = dict(num_rows=R, device_batch_size=B, num_sc=1, num_partitions=layout[2])

    def xla(opt):
        def f(csr, t, acc, g):
            rows, gr = update_jax.row_gradients(*csr, g, **kw)
            if opt == "sgd":
                return update_jax.sgd(t, rows, gr, LR), acc
            return update_jax.adagrad(t, acc, rows, gr, LR, EPS)

        return jax.jit(f, donate_argnums=(1, 2))

    def stream(opt):
        def f(csr, t, acc, g):
            e = decode(*csr, **dec)
            new_t, new_acc = pallas_stream.update(
                t, acc if opt != "sgd" else None, e, g, LR, EPS, optimizer=opt, interpret=CPU
            )
            return new_t, acc if new_acc is None else new_acc

        return jax.jit(f, donate_argnums=(1, 2))

    def plain(opt, ids, smp):
        def f(csr, t, acc, g):
            if opt == "sgd":
                return t.at[ids].add(g[smp] * -LR), acc
            dense = jax.ops.segment_sum(g[smp], ids, num_segments=R)
            acc = acc + jnp.mean(dense * dense, axis=1)
            return t + dense * (-LR / (jnp.sqrt(acc) + EPS))[:, None], acc

        return jax.jit(f, donate_argnums=(1, 2))

    return xla, stream, plain


def cell(R, D, B, H, dist):
    head, layout, n = csr_for(R, B, H, dist, seed=D + H)
    e = decode(*head, num_rows=R, device_batch_size=B, num_sc=1, num_partitions=layout[2])
    valid = np.asarray(e.valid)
    ids, smp = jnp.asarray(np.asarray(e.rows)[valid]), jnp.asarray(np.asarray(e.samples)[valid])
    grad = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
    xla, stream, plain = programs(R, D, B, layout)

    def fresh():
        return jax.random.normal(jax.random.key(0), (R, D), jnp.float32), jnp.zeros(R, jnp.float32)

    fs, st, diffs = {}, {}, {}
    for opt in ("sgd", "rowwise_adagrad"):
        for name, make in (("xla", xla), ("stream", stream), ("plain", lambda o: plain(o, ids, smp))):
            fs[f"{opt}_{name}"], st[f"{opt}_{name}"] = make(opt), fresh()
        first = {k: np.asarray(fs[k](head, *fresh(), grad)[0]) for k in (f"{opt}_xla", f"{opt}_stream", f"{opt}_plain")}
        diffs[opt] = {k: float(np.max(np.abs(first[k] - first[f"{opt}_xla"]))) for k in first}

    def step(k):
        def run():
            st[k] = fs[k](head, *st[k], grad)
            return st[k]

        return run

    ms = timed_rounds({k: step(k) for k in fs}, rounds=2 if CPU else 5, reps=1 if CPU else 10)
    return {
        "cell": f"{R}x{D} B{B} H{H} {dist}",
        "max_abs_diff_vs_xla_after_1_step": diffs,
        "ms": {k: round(v, 4) for k, v in ms.items()},
    }


def main():
    cells = (
        [(3072, 128, 64, 4, "uniform")]
        if CPU
        else [
            (1_000_000, 128, 16384, 8, "uniform"),
            (1_000_000, 128, 16384, 8, "zipf"),
            (1_000_000, 256, 16384, 8, "uniform"),
        ]
    )
    run_cells(cells, cell, "stream")


if __name__ == "__main__":
    main()
