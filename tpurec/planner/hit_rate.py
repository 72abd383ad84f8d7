"""The hit rate a host-tier table's cache should reach, from its hot-row curve (hot_rows.py).

The cache counts per batch: each distinct row a batch uses is a hit (already cached) or a miss
(loaded), so the model works in batches too. Between two points of the curve the rows are taken as
equally popular: a row of segment j receives a share p_j of the table's ids, so with n ids a batch
it appears in a batch with probability q_j = 1 - (1 - p_j)^n (ids drawn independently).

- LRU (the row used by the oldest batch leaves first): Che's approximation in batches. A row is
  cached when it was used within the last T batches, T the "characteristic time" at which the rows
  used in T batches fill the cache: sum_j m_j (1 - (1 - q_j)^T) = C (m_j rows in segment j). The hit
  rate is then sum_j m_j q_j (1 - (1 - q_j)^T) / sum_j m_j q_j.
- LFU (the least used row since the run started leaves first; counts survive eviction): the C most
  used rows' share of the batches' rows. An upper bound: each batch's misses are pinned in slots the
  hot rows would hold, so the cache keeps fewer of them (a simulation of the policy measured 3 to 10
  points below it; LRU's figure within 3).

Both are steady-state figures: the first C misses, filling the cache, are not in them. Rows no id
touched while measuring have p = 0. A row-wise table's shards each cache their own rows; the model
takes the table as one cache of all the shards' rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tpurec.planner.hot_rows import HotRows


@dataclass(frozen=True)
class CacheEstimate:
    """A cache's expected steady state: the share of a batch's distinct rows found cached, and how
    many distinct rows a batch uses."""

    hit_rate: float
    rows_per_batch: float

    @property
    def misses_per_batch(self) -> float:
        return self.rows_per_batch * (1.0 - self.hit_rate)


def _segments(curve: HotRows) -> tuple[np.ndarray, np.ndarray]:
    """(rows, share of the ids per row) of each stretch between two points of the curve."""
    k = np.array((0,) + curve.top_k, dtype=np.float64)
    c = np.array((0.0,) + curve.covered, dtype=np.float64)
    m = np.diff(k)
    keep = m > 0
    return m[keep], np.clip(np.diff(c)[keep] / np.where(keep, np.diff(k), 1)[keep], 0.0, 1.0)


def _unseen(q: np.ndarray, t: float) -> np.ndarray:
    """The chance a row of batch probability q is not among the rows of the last t batches: (1 - q)^t
    at whole t; between whole numbers the older batch's rows are kept in part (a share f of them, the
    cache's rows of one batch being equally recent), (1 - q)^floor(t) (1 - f q)."""
    whole = math.floor(t)
    with np.errstate(divide="ignore"):
        kept = np.exp(whole * np.log1p(-q)) if whole else np.ones_like(q)
    return kept * (1.0 - (t - whole) * q)


def estimate(curve: HotRows, cached_rows: int, ids_per_batch: float, algorithm: str = "lru") -> CacheEstimate:
    """The expected hit rate of a cache of `cached_rows` rows over batches of `ids_per_batch` ids of
    the table whose ids follow `curve`; `algorithm` "lru" or "lfu"."""
    m, p = _segments(curve)
    q = _batch_chance(p, ids_per_batch)
    used = float((m * q).sum())
    if used <= 0.0:
        return CacheEstimate(0.0, 0.0)
    if cached_rows >= curve.rows_seen:
        return CacheEstimate(1.0, used)
    if algorithm == "lfu":
        taken = np.minimum(m, np.maximum(0.0, cached_rows - np.concatenate(([0.0], np.cumsum(m)[:-1]))))
        return CacheEstimate(float((taken * q).sum()) / used, used)
    lo, hi = 1e-9, 1e18  # batches; the rows used in T batches grow with T up to the rows seen
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if float((m * (1.0 - _unseen(q, mid))).sum()) < cached_rows:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    # Whether a batch's row was used in the last T batches, from the row's OTHER ids (leave one out):
    # a curve counted over a finite run gives a row seen c times the share c / N, its own id included,
    # which makes sampling noise look like popularity (uniform ids over a few ids a row looked skewed:
    # 25% for a cache of 20% of the rows). (c - 1) / N is unbiased for an id's row's share elsewhere; the
    # simulated LRU cache agrees within a point where it was 3 to 7 points under the plain figure
    # (tests/planner/test_hot_rows.py). T stays the plain fill's: the rows a run of batches brings.
    q_other = _batch_chance(np.maximum(p - 1.0 / max(curve.ids, 1), 0.0), ids_per_batch)
    hit = float((m * q * (1.0 - _unseen(q_other, hi))).sum()) / used
    return CacheEstimate(min(1.0, hit), used)


def _batch_chance(p: np.ndarray, ids_per_batch: float) -> np.ndarray:
    """1 - (1 - p)^n: the chance a row of id share p is among a batch's n ids (exact for small p)."""
    q = -np.expm1(ids_per_batch * np.log1p(-np.minimum(p, 1 - 1e-15)))
    return np.where(p >= 1.0, 1.0, q)
