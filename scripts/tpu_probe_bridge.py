"""Chip probe 2: torch_tpu jax_op: a lookup and a donated in-place SGD update on torch tensors."""

import json
import os
import time

import jax
import jax.numpy as jnp
import torch
from torch_tpu._internal.pallas import jax_op

out = {"torch": torch.__version__}


def lookup(table: jax.Array, ids: jax.Array, samples: jax.Array, gains: jax.Array, batch: int) -> jax.Array:
    rows = jnp.take(table, ids, axis=0, mode="clip").astype(jnp.float32) * gains[:, None]
    return jax.ops.segment_sum(rows, samples, num_segments=batch)


lookup_op = jax_op("tpurec_probe::lookup")(lookup)


def sgd(table: jax.Array, rows: jax.Array, grads: jax.Array, lr: jax.Array) -> jax.Array:
    return table.at[rows].add((-lr * grads).astype(table.dtype), mode="drop")


sgd_op = jax_op("tpurec_probe::sgd", donate_argnums=(0,))(sgd)
sgd_keep = jax_op("tpurec_probe::sgd_keep")(sgd)
dev = torch.device("tpu")
R, D, N, B = 1_000_000, 128, 131_072, 16_384
g = torch.Generator().manual_seed(0)
table_cpu = torch.randn(R, D, generator=g)
ids = torch.randint(0, R, (N,), generator=g, dtype=torch.int32)
samples = torch.sort(torch.randint(0, B, (N,), generator=g, dtype=torch.int32)).values
gains = torch.rand(N, generator=g)
t = table_cpu.to(dev)
i, s, gg = ids.to(dev), samples.to(dev), gains.to(dev)
y = lookup_op(t, i, s, gg, B)
ref = torch.zeros(B, D).index_add_(0, samples.long(), table_cpu[ids.long()] * gains[:, None])
out["lookup_max_abs_err"] = float((y.cpu() - ref).abs().max())


def tm(f, n=20):
    f().reshape(-1)[:1].cpu()
    t0 = time.perf_counter()
    for _ in range(n):
        r = f()
    r.reshape(-1)[:1].cpu()  # waits for the queue
    return (time.perf_counter() - t0) / n * 1e3


out["lookup_ms"] = tm(lambda: lookup_op(t, i, s, gg, B))
rows = torch.unique(ids.long()).to(torch.int32)
U = rows.numel()
rows_pad = torch.full((N,), R, dtype=torch.int32)
rows_pad[:U] = rows
grads = torch.randn(N, D, generator=g)
rp, gr = rows_pad.to(dev), grads.to(dev)
lr = torch.tensor(0.01).to(dev)
param = torch.nn.Parameter(table_cpu.clone().to(dev), requires_grad=False)
ptr0 = param.data_ptr() if hasattr(param, "data_ptr") else None


def step_set():
    with torch.no_grad():
        new = sgd_op(param, rp, gr, lr)
        param.set_(new)
    return param


def step_copy():
    with torch.no_grad():
        new = sgd_keep(param, rp, gr, lr)
        param.copy_(new)
    return param


step_set()
exp = table_cpu.clone()
exp[rows.long()] += -0.01 * grads[:U]
out["set_update_max_abs_err"] = float((param.detach().cpu() - exp).abs().max())
out["sgd_donate_set_ms"] = tm(step_set)
out["sgd_copy_ms"] = tm(step_copy)
out["lookup_bytes_per_s"] = N * D * 4 / (out["lookup_ms"] / 1e3)
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe2_torch.json"), "w"), indent=1)
