"""LRU's victims in O(victims), not O(cache): the cache's slots in the order their rows were last used.

Choosing the k least recently used of C slots by sorting their last-use batch numbers costs O(C) a
batch: 7 ms of a 16,384 x 8 batch at a 4M-row table's 20% cache (800,000 slots) on a 2-core host, half
the tier's bookkeeping. Here every batch appends the slots it used, in one array, to a queue; the
front of the queue is the oldest use. An entry is stale when its slot was used again later (its
last-use batch is not the entry's) or holds no row any more: stale entries are dropped as the front
reaches them. So the victims are taken from the front, skipping stale entries, the batch's own slots
and, on a first pass, the rows in flight (table_tier.py), in LRU order: equal last uses in the order
the batch listed them.

Live entries are at most the cache's slots; stale ones pile up only while nothing is evicted (a cache
not yet full) or a hot row is used again and again, and are rebuilt from the last uses (one sort)
when the queue holds four times the cache.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tpurec.embedding.host_tier.slot_map import EMPTY


class LruQueue:
    """The slots by last use; `last_used` is the policy's per-slot batch number of the last use."""

    def __init__(self, last_used: np.ndarray) -> None:
        self.last_used = last_used
        self._entries: deque[tuple[int, np.ndarray]] = deque()  # (batch, slots it used), oldest first
        self._size = 0  # slots queued, stale ones included

    def used(self, batch: int, slots: np.ndarray) -> None:
        """Batch `batch` used `slots` (distinct; `last_used[slots]` is `batch` now)."""
        if slots.size:
            self._entries.append((batch, slots.copy()))
            self._size += slots.size
        if self._size > 4 * self.last_used.size + 1024:
            self._rebuild()

    def oldest(self, k: int, row_of: np.ndarray, kept: np.ndarray, flight: np.ndarray) -> np.ndarray:
        """Up to `k` occupied slots (`row_of[slot]` not EMPTY), least recently used first, never one of
        the batch's own (`kept`, a mask over the slots) and rows in `flight` (a mask) last."""
        chosen: list[np.ndarray] = []
        spared: list[tuple[int, np.ndarray]] = []  # live entries of rows in flight, in queue order
        need = k
        while need and self._entries:
            batch, slots = self._entries.popleft()
            self._size -= slots.size
            # (a kept slot's entry is dropped: the batch uses it again, a newer entry follows)
            live = slots[(self.last_used[slots] == batch) & (row_of[slots] != EMPTY) & ~kept[slots]]
            flying = flight[live]
            if flying.any():
                spared.append((batch, live[flying]))
                live = live[~flying]
            take = live[:need]
            chosen.append(take)
            need -= take.size
            self._push_front(batch, live[take.size :])  # the rest of this entry stays at the front
        left = []
        for batch, slots in spared:  # nothing else was left: rows in flight, oldest first
            take = slots[:need]
            chosen.append(take)
            need -= take.size
            left.append((batch, slots[take.size :]))
        for batch, slots in reversed(left):  # older than the front: back in their place
            self._push_front(batch, slots)
        return np.concatenate(chosen) if chosen else np.empty(0, np.int64)

    def _push_front(self, batch: int, slots: np.ndarray) -> None:
        if slots.size:
            self._entries.appendleft((batch, slots))
            self._size += slots.size

    def _rebuild(self) -> None:
        """One live entry per used slot, oldest first: the queue without its stale entries."""
        used = np.flatnonzero(self.last_used > 0)
        order = used[np.argsort(self.last_used[used], kind="stable")]
        batches = self.last_used[order]
        cuts = np.flatnonzero(np.diff(batches)) + 1
        self._entries = deque((int(b[0]), s) for b, s in zip(np.split(batches, cuts), np.split(order, cuts)))
        self._size = int(order.size)
