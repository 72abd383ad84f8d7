"""Chip probe 8: the update's duplicate-row merge by the Pallas kernel (pallas_merge: running sums in
slot order, the gradient in VMEM, no compaction) against XLA's (update_jax._merge_in_slot_order:
gather of gradient rows, sorted segment sum, scatter of the distinct rows), alone and inside the SGD
and row-wise Adagrad steps (tables donated); and plain JAX's `.at[ids].add` SGD for scale.
Cells: 1M rows, batch 16,384 x pooling 8; widths 16, 128, 256 uniform, 128 Zipf. Contenders
interleave in a random order per round; results compared once (rows sorted, bit for bit).
Writes $OUT/merge.json. Usage: python3 scripts/tpu_probe_merge.py [--cpu]
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from tpu_probe_pool import block, csr_for, run_cells, timed_rounds  # noqa: E402

from tpurec.embedding.tensorcore import update_jax  # noqa: E402

CPU = "--cpu" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
LR, EPS = jnp.float32(0.01), jnp.float32(1e-8)


def cell(R, D, B, H, dist):
    head, layout, n = csr_for(R, B, H, dist, seed=D + H)
    parts = layout[2]
    grad = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
    kw = dict(num_rows=R, width=D, device_batch_size=B, num_sc=1, num_partitions=parts)

    def rg(merge):
        return jax.jit(
            lambda csr, g: update_jax.row_gradients(*csr, g, **kw, merge_kernel=merge, interpret=CPU and merge)
        )

    def sgd(merge):
        def f(csr, t, g):
            rows, gr = update_jax.row_gradients(*csr, g, **kw, merge_kernel=merge, interpret=CPU and merge)
            return update_jax.sgd(t, rows, gr, LR, rows_sorted=not merge)

        return jax.jit(f, donate_argnums=1)

    def adagrad(merge):
        def f(csr, t, acc, g):
            rows, gr = update_jax.row_gradients(*csr, g, **kw, merge_kernel=merge, interpret=CPU and merge)
            return update_jax.adagrad(t, acc, rows, gr, LR, EPS, rows_sorted=not merge)

        return jax.jit(f, donate_argnums=(1, 2))

    # equal work: the merged rows, sorted, bit for bit
    (r0, g0), (r1, g1) = block(rg(False)(head, grad)), block(rg(True)(head, grad))
    r0, g0, r1, g1 = (np.asarray(x) for x in (r0, g0, r1, g1))
    k0, k1 = r0 != R, r1 != R
    o1 = np.argsort(r1[k1])
    same_rows = bool(np.array_equal(r0[k0], r1[k1][o1]))
    grad_diff = float(np.max(np.abs(g0[k0] - g1[k1][o1]))) if same_rows else None

    table = functools.partial(jax.random.normal, jax.random.key(0), (R, D), jnp.float32)
    st = {"sgd_xla": table(), "sgd_pallas": table(), "sgd_plain": table()}
    st.update({"adagrad_xla": (table(), jnp.zeros(R)), "adagrad_pallas": (table(), jnp.zeros(R))})
    fs = {"rg_xla": rg(False), "rg_pallas": rg(True), "sgd_xla": sgd(False), "sgd_pallas": sgd(True)}
    fs.update({"adagrad_xla": adagrad(False), "adagrad_pallas": adagrad(True)})
    e_ids = jax.random.randint(jax.random.key(3), (B * H,), 0, R)
    e_smp = jnp.repeat(jnp.arange(B), H)
    plain = jax.jit(lambda t, g: t.at[e_ids].add(g[e_smp] * -LR), donate_argnums=0)

    def step(name):
        def run():
            if name.startswith("rg_"):
                return fs[name](head, grad)
            if name == "sgd_plain":
                st[name] = plain(st[name], grad)
            elif name.startswith("sgd"):
                st[name] = fs[name](head, st[name], grad)
            else:
                st[name] = fs[name](head, *st[name], grad)
            return st[name]

        return run

    after1 = {}
    for name in ("sgd_xla", "sgd_pallas"):
        after1[name] = np.asarray(step(name)())
    sgd_diff = float(np.max(np.abs(after1["sgd_xla"] - after1["sgd_pallas"])))
    ms = timed_rounds({k: step(k) for k in [*fs, "sgd_plain"]}, rounds=2 if CPU else 5, reps=1 if CPU else 20)
    return {
        "cell": f"{R}x{D} B{B} H{H} {dist}",
        "distinct_rows": int(k0.sum()),
        "same_rows": same_rows,
        "merged_grad_max_abs_diff": grad_diff,
        "sgd_table_max_abs_diff_after_1_step": sgd_diff,
        "ms": {k: round(v, 4) for k, v in ms.items()},
    }


def main():
    cells = (
        [(3000, 128, 64, 4, "uniform")]
        if CPU
        else [
            (1_000_000, 128, 16384, 8, "uniform"),
            (1_000_000, 128, 16384, 8, "zipf"),
            (1_000_000, 16, 16384, 8, "uniform"),
            (1_000_000, 256, 16384, 8, "uniform"),
        ]
    )
    run_cells(cells, cell, "merge")


if __name__ == "__main__":
    main()
