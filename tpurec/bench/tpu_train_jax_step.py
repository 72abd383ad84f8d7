"""The plain-JAX training step of `tpurec bench tpu-train`: one jitted program, parameters and state donated.

What a JAX user writes for DLRM with sparse table updates:
- lookup: `jnp.take` of each table's rows for its [batch, hots] ids, summed over the multi-hot axis;
- `jax.value_and_grad` of the loss with respect to the dense parameters and the gathered rows (so no
  [rows, dim] gradient of a table is ever formed);
- dense parameters: Adagrad as torch.optim.Adagrad does it (sum += g^2; p -= lr g / (sqrt(sum) + eps));
- tables: row-wise Adagrad as FBGEMM's EXACT_ROWWISE_ADAGRAD does it (TorchRec's DLRM example and
  tpurec's fused optimizer): each distinct row's gradient summed over its occurrences first
  (`jnp.unique` of the ids with a static size, then `segment_sum`), acc[row] += mean(g_row^2),
  row -= lr g_row / (sqrt(acc[row]) + eps), written back with `.at[rows].add/.set` (padding slots of
  the unique ids point past the table and are dropped).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tpurec.bench.tpu_train_jax_model import Params, bce_with_logits, logits
from tpurec.bench.tpu_train_shapes import Workload

Batch = dict[str, Any]  # "ids": [batch * hots] int32 per table (sample-major), "dense": [batch, 13], "labels": [batch]


def init_state(params: Params) -> Params:
    """Adagrad's accumulators: one f32 per table row, one per dense parameter; all zero (torch's default)."""
    return {
        "tables": [jnp.zeros((t.shape[0],), jnp.float32) for t in params["tables"]],
        "dense": jax.tree.map(jnp.zeros_like, params["dense"]),
    }


def _adagrad(p: jax.Array, acc: jax.Array, g: jax.Array, lr: float, eps: float) -> tuple[jax.Array, jax.Array]:
    acc = acc + g * g
    return p - lr * g / (jnp.sqrt(acc) + eps), acc


def rowwise_adagrad(
    table: jax.Array, acc: jax.Array, ids: jax.Array, row_grads: jax.Array, lr: float, eps: float
) -> tuple[jax.Array, jax.Array]:
    """Exact row-wise Adagrad on the rows `ids` ([n] ids, [n, dim] gradients of each occurrence)."""
    rows = table.shape[0]
    size = min(ids.shape[0], rows)  # at most this many distinct ids: the static size unique needs
    uniq, inv = jnp.unique(ids, size=size, fill_value=rows, return_inverse=True)
    g = jax.ops.segment_sum(row_grads, inv.reshape(-1), num_segments=size)
    new_acc = acc.at[uniq].get(mode="fill", fill_value=0.0) + jnp.mean(g * g, axis=1)
    step = (-lr / (jnp.sqrt(new_acc) + eps))[:, None] * g
    return table.at[uniq].add(step, mode="drop"), acc.at[uniq].set(new_acc, mode="drop")


def _loss(dense_params: Params, gathered: list[jax.Array], batch: Batch) -> jax.Array:
    pooled = [rows.sum(axis=1) for rows in gathered]  # sum pooling over the fixed multi-hot axis
    return bce_with_logits(logits(dense_params, pooled, batch["dense"]), batch["labels"])


def train_step(w: Workload, params: Params, state: Params, batch: Batch) -> tuple[Params, Params, jax.Array]:
    """One step: (new params, new state, the batch's loss before the update)."""
    shaped = [ids.reshape(w.batch, h) for ids, h in zip(batch["ids"], w.hots)]
    gathered = [jnp.take(t, ids, axis=0) for t, ids in zip(params["tables"], shaped)]  # [batch, hots, dim]
    loss, (g_dense, g_rows) = jax.value_and_grad(_loss, argnums=(0, 1))(params["dense"], gathered, batch)
    leaves, tree = jax.tree.flatten(params["dense"])
    acc_leaves, grads = jax.tree.leaves(state["dense"]), jax.tree.leaves(g_dense)
    pairs = [_adagrad(p, a, g, w.dense_lr, w.eps) for p, a, g in zip(leaves, acc_leaves, grads)]
    dense = jax.tree.unflatten(tree, [p for p, _ in pairs])
    dense_acc = jax.tree.unflatten(tree, [a for _, a in pairs])
    tables, accs = [], []
    for t, acc, ids, g in zip(params["tables"], state["tables"], batch["ids"], g_rows):
        t, acc = rowwise_adagrad(t, acc, ids, g.reshape(-1, w.dim), w.embedding_lr, w.eps)
        tables.append(t)
        accs.append(acc)
    return {"tables": tables, "dense": dense}, {"tables": accs, "dense": dense_acc}, loss


@functools.lru_cache(maxsize=4)
def jitted_step(w: Workload) -> Callable[[Params, Params, Batch], tuple[Params, Params, jax.Array]]:
    """train_step jitted end to end, the parameters and the state donated (updated in place). One per
    workload in a process: a later `train` of the same workload reuses its compiled program (a new
    `jax.jit` of a new partial compiled it again). The bench runs a process per round, so this serves
    in-process callers: the CPU tests that train one workload twice."""
    return jax.jit(functools.partial(train_step, w), donate_argnums=(0, 1))
