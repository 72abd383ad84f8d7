"""The one workload generator of the benchmarks: Zipf-distributed ids and the KJTs built from them.

Which Zipf law each benchmark uses (unchanged by the move into this package, so figures stay
comparable with earlier runs):

* `tpurec bench kernels` and `tpurec bench preprocess`: `zipf_ids` below, numpy's discrete
  ``rng.zipf(a)`` (a = 1.05) folded into the vocabulary as ``(z - 1) % vocab``. Folding keeps the
  tail that numpy draws beyond the vocabulary, so the law is not truncated. `kernels` also scatters
  the hot ids over the table with a fixed permutation (``scatter_seed=12345``); `preprocess` does
  not (hot ids at rows 0, 1, 2, ..., the input jax-tpu-embedding's comparison has always used).
* `tpurec bench data` and `tpurec bench train`: the synthetic training data of `tpurec.data.synth`,
  whose ids follow the continuous approximation of a Zipf law (exponent 1.1) truncated to the
  vocabulary and scattered by an affine bijection. That generator is library code (layer 1) and
  stays there; the benchmarks call `synthesize` rather than sample ids themselves.

Every function takes the caller's numpy Generator, so a seed fixes the whole workload; drawing
``[batch, pooling]`` ids at once gives the same ids, row-major, as drawing ``batch * pooling``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import functools

import numpy as np

ZIPF_A = 1.05  # exponent of the kernel and preprocessing benchmarks (the workload)
SCATTER_SEED = 12345  # the fixed permutation `tpurec bench kernels` scatters hot ids with


@functools.lru_cache(maxsize=8)
def _permutation(vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(vocab)


def zipf_ids(
    rng: np.random.Generator,
    size: int | tuple[int, ...],
    vocab: int,
    a: float = ZIPF_A,
    scatter_seed: int | None = None,
) -> np.ndarray:
    """int64 ids in [0, vocab) of shape `size`: numpy's discrete Zipf(a) ranks folded into the vocabulary.

    With `scatter_seed`, rank r becomes row ``permutation(vocab)[r]`` (hot ids spread over the table
    rather than packed at row 0); the permutation depends only on (vocab, seed).
    """
    ids = (rng.zipf(a, size) - 1) % vocab
    return ids if scatter_seed is None else _permutation(vocab, scatter_seed)[ids]


def fixed_pooling_ids(
    rng: np.random.Generator,
    num_features: int,
    batch: int,
    pooling: int,
    vocab: int,
    a: float = ZIPF_A,
    scatter_seed: int | None = None,
) -> list[np.ndarray]:
    """One [batch, pooling] id array per feature, features drawn in turn: every bag holds `pooling` ids."""
    return [zipf_ids(rng, (batch, pooling), vocab, a, scatter_seed) for _ in range(num_features)]


def variable_pooling_ids(
    rng: np.random.Generator,
    num_features: int,
    batch: int,
    max_len: int,
    vocab: int,
    zipf: bool,
    a: float = ZIPF_A,
    scatter_seed: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (ids, lengths) pair per feature: bag lengths uniform in 0..max_len (empty bags included),
    ids Zipf(a) (`zipf_ids`) or uniform over the vocabulary; features drawn in turn."""
    out = []
    for _ in range(num_features):
        lengths = rng.integers(0, max_len + 1, batch)
        n = int(lengths.sum())
        ids = zipf_ids(rng, n, vocab, a, scatter_seed) if zipf else rng.integers(0, vocab, n)
        out.append((ids.astype(np.int64), lengths.astype(np.int64)))
    return out


def jagged_kjt(features: list[tuple[np.ndarray, np.ndarray]], keys: list[str]) -> KeyedJaggedTensor:
    """A torchrec KeyedJaggedTensor of features given as (ids, lengths) pairs, in keys order."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = np.concatenate([ids for ids, _ in features])
    lengths = np.concatenate([lens for _, lens in features])
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths))


def kjt(ids: list[np.ndarray], keys: list[str]) -> KeyedJaggedTensor:
    """A torchrec KeyedJaggedTensor of fixed-pooling features: ids[k] is feature keys[k]'s [batch, pooling]."""
    return jagged_kjt([(x.reshape(-1), np.full(x.shape[0], x.shape[1], dtype=np.int64)) for x in ids], keys)
