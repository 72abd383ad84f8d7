"""Which cached rows leave first: TorchRec's (FBGEMM's) CacheAlgorithm.LRU and LFU.

LRU: the slot whose row was used by the oldest batch. LFU: the row used the fewest times since the
run started (every id of every batch counts, and a row keeps its count while it is out of the cache,
as FBGEMM's LFU keeps one counter per table row), the least recently used among equals. Which rows
leave changes only what is copied, never a number the step computes.
"""

from __future__ import annotations

import numpy as np
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

from tpurec.embedding.host_tier.lru_queue import LruQueue

# LFU's key packs (uses, last batch) into one int64: uses in the high 31 bits (a row used more than
# 2**31 - 1 times ranks with those used exactly that often), the batch number in the low 32.
_BATCH_BITS = 32
_MAX_USES = (1 << 31) - 1


class EvictionPolicy:
    """The recency of every cache slot and, for LFU, the use count of every table row."""

    def __init__(self, algorithm: CacheAlgorithm, rows: int, slots: int) -> None:
        self.algorithm = algorithm
        self.batch = 0  # batches seen: the clock of `last_used`
        self.last_used = np.zeros(slots, np.int64)  # per slot: the batch that last used its row
        self.uses = np.zeros(rows if algorithm == CacheAlgorithm.LFU else 0, np.int64)  # per table row
        # LRU: the slots by last use, its victims in O(victims) (lru_queue.py); LFU sorts its keys
        self.queue = LruQueue(self.last_used) if algorithm == CacheAlgorithm.LRU else None

    def touch(self, rows: np.ndarray, counts: np.ndarray | None, slots: np.ndarray) -> None:
        """A batch used `rows` (distinct), `counts` times each (LFU's alone: None for LRU), now held in
        `slots`."""
        self.batch += 1
        self.last_used[slots] = self.batch
        if self.queue is not None:
            self.queue.used(self.batch, slots)
        if self.uses.size:
            assert counts is not None
            self.uses[rows] += counts

    def victims(self, candidates: np.ndarray, row_of: np.ndarray, k: int) -> np.ndarray:
        """The `k` slots of `candidates` (occupied slots, holding rows `row_of[slot]`) to evict first."""
        if k >= candidates.size:
            return candidates
        key = self.last_used[candidates] & ((1 << _BATCH_BITS) - 1)
        if self.uses.size:
            key = key | (np.minimum(self.uses[row_of[candidates]], _MAX_USES) << _BATCH_BITS)
        return candidates[np.argpartition(key, k - 1)[:k]]
