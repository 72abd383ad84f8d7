"""Chip probe 6: where a lookup's and an update's time goes, XLA's index hints, and the Pallas issue rate.

One cell (1M x 128 f32, batch 16,384 x pooling 8, uniform ids, tpurec's CSR). Lookup: the XLA program;
the gather alone (unsorted, sorted hint); gather + segment_sum with the hint; Pallas row gather alone
and pooled lookup at unroll 8 / 32. Update (SGD, tables donated): the XLA program; its parts (grad
rows gather, segment sum); the scatter with unique/sorted hints; one scatter-add with the hints.
Contenders interleave in a random order per round; outputs compared to the program's once.
Writes $OUT/variants.json. Usage: python3 scripts/tpu_probe_variants.py [--cpu]
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from tpu_probe_pallas import block, csr_for, timed_rounds  # noqa: E402

from tpurec.embedding.tensorcore import pallas_lookup, pallas_rows, programs, update_jax  # noqa: E402
from tpurec.embedding.tensorcore.csr_jax import decode  # noqa: E402

CPU = "--cpu" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
R, D, B, H = (5000, 128, 64, 8) if CPU else (1_000_000, 128, 16384, 8)


def entries(layout, csr, num_rows):
    batch, num_sc, parts = layout
    e = decode(*csr, num_rows=num_rows, device_batch_size=batch, num_sc=num_sc, num_partitions=parts)
    # one SparseCore: valid rows increase in slot order; an invalid slot takes the row before it
    mono = jax.lax.cummax(jnp.where(e.valid, e.rows, 0))
    return e, mono


def main():
    head, layout, n = csr_for(R, B, H, "uniform", seed=7)
    table = jax.random.normal(jax.random.key(0), (R, D), jnp.float32)
    grad = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
    out = {"jax": jax.__version__, "cell": f"{R}x{D} f32 B{B} H{H} uniform", "n_ids": n}

    @jax.jit
    def take_plain(csr, t):
        e, _ = entries(layout, csr, R)
        return t[jnp.where(e.valid, e.rows, 0)]

    @jax.jit
    def take_sorted(csr, t):
        _, mono = entries(layout, csr, R)
        return t.at[mono].get(indices_are_sorted=True, mode="clip")

    @jax.jit
    def lookup_sorted(csr, t):
        e, mono = entries(layout, csr, R)
        v = t.at[mono].get(indices_are_sorted=True, mode="clip") * e.gains[:, None]
        return jax.ops.segment_sum(v, e.samples, num_segments=B)

    @functools.partial(jax.jit, static_argnums=2)
    def pallas_gather(csr, t, unroll):
        e, _ = entries(layout, csr, R)
        return pallas_rows.gather_rows(t, jnp.where(e.valid, e.rows, 0), chunk=1024, unroll=unroll, interpret=CPU)

    @functools.partial(jax.jit, static_argnums=2)
    def pallas_pooled(csr, t, unroll):
        e, _ = entries(layout, csr, R)
        rows = jnp.where(e.valid, e.rows, 0)
        return pallas_lookup.pooled_lookup(
            rows, e.samples, e.gains, t, device_batch_size=B, chunk=1024, unroll=unroll, interpret=CPU
        )

    xla = jax.jit(functools.partial(programs._lookup, layout))
    want = np.asarray(block(xla(*head, table)))
    lk = {
        "xla_program": lambda: xla(*head, table),
        "take_plain": lambda: take_plain(head, table),
        "take_sorted_hint": lambda: take_sorted(head, table),
        "lookup_sorted_hint": lambda: lookup_sorted(head, table),
        "pallas_gather_u8": lambda: pallas_gather(head, table, 8),
        "pallas_gather_u32": lambda: pallas_gather(head, table, 32),
        "pallas_pooled_u8": lambda: pallas_pooled(head, table, 8),
        "pallas_pooled_u32": lambda: pallas_pooled(head, table, 32),
    }
    out["lookup_err"] = {
        k: float(np.abs(np.asarray(block(lk[k]())) - want).max())
        for k in ("lookup_sorted_hint", "pallas_pooled_u8", "pallas_pooled_u32")
    }
    out["gather_equal"] = bool(jnp.array_equal(take_plain(head, table), pallas_gather(head, table, 8)))
    out["lookup_ms"] = timed_rounds(lk, rounds=5, reps=10)
    print(json.dumps(out), flush=True)

    lr = jnp.float32(0.01)

    def rg(csr):
        return update_jax.row_gradients(
            *csr, grad, num_rows=R, width=D, device_batch_size=B, num_sc=1, num_partitions=layout[2]
        )

    @jax.jit
    def grad_rows_gather(csr):
        e, _ = entries(layout, csr, R)
        return grad[jnp.where(e.valid, e.samples, 0)]

    @functools.partial(jax.jit, donate_argnums=1)
    def sgd_hinted_set(csr, t):
        rows, g = rg(csr)
        old = t.at[rows].get(mode="fill", fill_value=0, indices_are_sorted=True, unique_indices=True)
        return t.at[rows].set(old + g * -lr, mode="drop", indices_are_sorted=True, unique_indices=True)

    @functools.partial(jax.jit, donate_argnums=1)
    def sgd_hinted_add(csr, t):
        rows, g = rg(csr)
        return t.at[rows].add(g * -lr, mode="drop", indices_are_sorted=True, unique_indices=True)

    @functools.partial(jax.jit, donate_argnums=1)
    def sgd_pallas_add(csr, t):
        rows, g = rg(csr)
        return pallas_rows.add_rows(t, rows, g * -lr, chunk=1024, unroll=16, interpret=CPU)

    xla_sgd = jax.jit(functools.partial(programs._sgd, layout), donate_argnums=1)
    tables = {}
    fns = {
        "xla_program": xla_sgd,
        "hinted_set": sgd_hinted_set,
        "hinted_add": sgd_hinted_add,
        "pallas_add": sgd_pallas_add,
    }
    for k, f in fns.items():
        tables[k] = f(head, jnp.array(table), grad, lr) if k == "xla_program" else f(head, jnp.array(table))
    out["update_err"] = {k: float(jnp.abs(tables[k] - tables["xla_program"]).max()) for k in tables}

    def call(k):
        f = fns[k]
        tables[k] = f(head, tables[k], grad, lr) if k == "xla_program" else f(head, tables[k])
        return tables[k]

    up = {k: functools.partial(call, k) for k in fns}
    rgj = jax.jit(rg)
    up["row_gradients"] = lambda: rgj(head)
    up["grad_rows_gather"] = lambda: grad_rows_gather(head)
    out["update_ms"] = timed_rounds(up, rounds=5, reps=10)
    print(json.dumps(out), flush=True)
    json.dump(out, open(os.path.join(OUT, "variants.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
