"""DLRM-DCNv2 in plain JAX: the parameters as a pytree, the forward pass and the loss.

The same model as `tpurec train --model mlperf-dcnv2` builds (TorchRec's DLRM_DCN): the bottom MLP
(ReLU after every layer) maps the dense features to one embedding-wide row; it and the 26 pooled
embeddings are concatenated (dense first) into x0; three low-rank cross layers
x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l; the top MLP (ReLU after all but its last layer) gives one
logit; the loss is binary cross-entropy on the logits. Initialisation as TorchRec's: tables uniform
+-sqrt(1/rows), linear layers uniform +-1/sqrt(fan_in), cross kernels Xavier-normal, cross biases 0.
Imported only by the JAX worker (jax at module top is fine there).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tpurec.bench.tpu_train_shapes import Workload

Params = dict[str, Any]


def _linear(key: jax.Array, n_in: int, n_out: int) -> tuple[jax.Array, jax.Array]:
    kw, kb = jax.random.split(key)
    bound = 1.0 / n_in**0.5
    w = jax.random.uniform(kw, (n_in, n_out), jnp.float32, -bound, bound)
    return w, jax.random.uniform(kb, (n_out,), jnp.float32, -bound, bound)


def _mlp(key: jax.Array, sizes: list[int]) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [_linear(k, a, b) for k, a, b in zip(keys, sizes, sizes[1:])]


def _xavier(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * (2.0 / sum(shape)) ** 0.5


def init_params(w: Workload, key: jax.Array) -> Params:
    """{"tables": [rows x dim] per table, "dense": {"bottom", "cross", "top"}}."""
    k_tab, k_bot, k_cross, k_top = jax.random.split(key, 4)
    tables = [
        jax.random.uniform(k, (rows, w.dim), jnp.float32, -((1.0 / rows) ** 0.5), (1.0 / rows) ** 0.5)
        for k, rows in zip(jax.random.split(k_tab, len(w.rows)), w.rows)
    ]
    width = w.dim * (len(w.rows) + 1)
    cross = []
    for k in jax.random.split(k_cross, w.dcn_layers):
        kv, kw = jax.random.split(k)
        cross.append(
            (_xavier(kv, (width, w.dcn_rank)), _xavier(kw, (w.dcn_rank, width)), jnp.zeros((width,), jnp.float32))
        )
    dense = {
        "bottom": _mlp(k_bot, [w.num_dense, *w.dense_arch]),
        "cross": cross,
        "top": _mlp(k_top, [width, *w.over_arch]),
    }
    return {"tables": tables, "dense": dense}


def _apply_mlp(layers: list[tuple[jax.Array, jax.Array]], x: jax.Array, relu_last: bool) -> jax.Array:
    for i, (weight, bias) in enumerate(layers):
        x = x @ weight + bias
        if relu_last or i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def logits(dense_params: Params, pooled: list[jax.Array], dense: jax.Array) -> jax.Array:
    """[batch] logits from the pooled embeddings (one [batch, dim] per table) and the dense features."""
    x0 = jnp.concatenate([_apply_mlp(dense_params["bottom"], dense, relu_last=True), *pooled], axis=1)
    x = x0
    for v, u, b in dense_params["cross"]:
        x = x0 * ((x @ v) @ u + b) + x
    return _apply_mlp(dense_params["top"], x, relu_last=False)[:, 0]


def bce_with_logits(z: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of logits z: log(1 + e^z) - y z, stable for large |z|."""
    return jnp.mean(jnp.logaddexp(0.0, z) - labels * z)
