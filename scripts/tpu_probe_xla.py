"""Chip probe 1: XLA lookup/update variants on v5e, and torch_tpu's jax_op with donation + set_."""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

out = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
R, D, N, B = 1_000_000, 128, 131_072, 16_384
rng = np.random.default_rng(0)
ids = rng.integers(0, R, N).astype(np.int32)
samples = np.sort(rng.integers(0, B, N)).astype(np.int32)
gains = rng.random(N).astype(np.float32)


def timeit(f, *a, n=20):
    r = f(*a)
    jax.block_until_ready(r)
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3


res = {}
for dt in (jnp.float32, jnp.bfloat16):
    table = jnp.asarray(rng.standard_normal((R, D), dtype=np.float32)).astype(dt)
    i, s, g = jnp.asarray(ids), jnp.asarray(samples), jnp.asarray(gains)

    @jax.jit
    def take_seg(t, i, s, g):
        rows = jnp.take(t, i, axis=0).astype(jnp.float32) * g[:, None]
        return jax.ops.segment_sum(rows, s, num_segments=B)

    @jax.jit
    def take_seg_sorted(t, i, s, g):
        rows = jnp.take(t, i, axis=0, mode="clip").astype(jnp.float32) * g[:, None]
        return jax.ops.segment_sum(rows, s, num_segments=B, indices_are_sorted=True)

    @jax.jit
    def take_only(t, i):
        return jnp.take(t, i, axis=0, mode="clip")

    @jax.jit
    def sort_i(i):
        return jnp.sort(i)

    @jax.jit
    def take_sorted_ids(t, i):  # gather in row order (better locality)
        return jnp.take(t, jnp.sort(i), axis=0, mode="clip")

    name = jnp.dtype(dt).name
    res[name] = {
        "take_segment_sum_ms": timeit(take_seg, table, i, s, g),
        "take_segment_sum_sorted_clip_ms": timeit(take_seg_sorted, table, i, s, g),
        "take_only_ms": timeit(take_only, table, i),
        "sort_ids_ms": timeit(sort_i, i),
        "take_sorted_ids_ms": timeit(take_sorted_ids, table, i),
    }
    # SGD update, donated, unique rows (padding dropped)
    uniq = np.unique(ids)
    U = len(uniq)
    rows_pad = np.full(N, R, np.int32)
    rows_pad[:U] = uniq
    grads = jnp.asarray(rng.standard_normal((N, D), dtype=np.float32))
    rp = jnp.asarray(rows_pad)

    @functools.partial(jax.jit, donate_argnums=0)
    def sgd(t, rows, gr, lr):
        return t.at[rows].add((-lr * gr).astype(t.dtype), mode="drop", unique_indices=True)

    @functools.partial(jax.jit, donate_argnums=0)
    def sgd_dup(t, rows, gr, lr):
        return t.at[rows].add((-lr * gr).astype(t.dtype), mode="drop")

    lr = jnp.float32(0.01)
    t2 = table
    for f, key in ((sgd, "sgd_scatter_unique_ms"), (sgd_dup, "sgd_scatter_dupflag_ms")):
        t2 = f(t2, rp, grads, lr)
        jax.block_until_ready(t2)
        t0 = time.perf_counter()
        for _ in range(20):
            t2 = f(t2, rp, grads, lr)
        jax.block_until_ready(t2)
        res[name][key] = (time.perf_counter() - t0) / 20 * 1e3

    # segment-sum of grads to unique rows via sort (what the fused update needs first)
    @jax.jit
    def dedup(i, gr):
        order = jnp.argsort(i)
        si = i[order]
        first = jnp.concatenate([jnp.ones(1, bool), si[1:] != si[:-1]])
        seg = jnp.cumsum(first) - 1
        summed = jax.ops.segment_sum(gr[order], seg, num_segments=N, indices_are_sorted=True)
        urows = jnp.full(N, R, jnp.int32).at[seg].set(si)
        return urows, summed

    res[name]["dedup_sort_segsum_ms"] = timeit(dedup, i, grads)
    del table, t2
out["xla"] = res
out["unique_ids"] = int(len(np.unique(ids)))
out["bytes_gathered_per_lookup_f32"] = N * D * 4
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe1_xla.json"), "w"), indent=1)
