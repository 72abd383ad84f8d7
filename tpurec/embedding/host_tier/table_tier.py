"""One table's host tier: the whole table on the host, `cached_rows` of its rows in the kernel's cache.

Before each batch (`map_ids`) the host, which sees every id, finds the batch's distinct rows in the
cache; the ones missing are loaded (row and optimizer state) into free slots, or into slots of
victims the eviction policy picks, whose rows are written back first when a step may have changed
them. The batch's own rows are never victims, so a batch's rows stay put from its forward to its
update. The kernel then runs on the cache with the batch's ids replaced by their slots.

The rows of a batch whose update has not run yet (its forward had gradients on; the table's stack
has not counted a step since) are "in flight": a later batch evicts them only when nothing else is
left to evict. `flush` makes the host table whole: it writes back every row an update may have
changed and empties the cache, except the rows in flight, whose update will land in the cache; they
are read from the host again before the next batch unless an update ran in between (then the
cache holds the newer values). So a checkpoint loaded into the host table in place between steps is
what the next step reads.

With the cache on a device, an eviction's write-back is started (the victims' rows gathered on the
device, queued before the loads that overwrite their slots) and completed (copied to the host table)
at the start of the next batch's `map_ids`, or at a `flush`, whichever comes first: copying them at
once would make the host wait for the device before it has queued this batch's step, so the device
would sit idle meanwhile. Nothing reads the host rows in between: a load happens only in `map_ids`,
and whole-table reads and writes go through `flush`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch

from tpurec.embedding.host_tier.device_copies import PendingWriteBack
from tpurec.embedding.host_tier.host_rows import Rows, copy_rows, start_copy_rows
from tpurec.embedding.host_tier.params import HostTierParams
from tpurec.embedding.host_tier.policy import EvictionPolicy
from tpurec.embedding.host_tier.slot_map import EMPTY, SlotMap
from tpurec.errors import UserError


@dataclass
class CacheCounters:
    """What the cache did since the run started (distinct rows per batch, summed over batches)."""

    batches: int = 0
    hits: int = 0  # distinct rows a batch found cached
    misses: int = 0  # distinct rows loaded from the host for a batch
    id_hits: int = 0  # ids whose row a batch found cached (a row used k times in a batch: k ids)
    id_misses: int = 0  # ids whose row was loaded
    evictions: int = 0  # rows that left the cache to make room
    writebacks: int = 0  # rows copied back to the host (evicted or flushed after an update may have changed them)
    flushes: int = 0  # times the host table was made whole (state_dict, checkpoints, loads)
    # host seconds spent in each part of `map_ids` (PHASES): on a chip, where a missed row's cost goes
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    @property
    def id_hit_rate(self) -> float:
        """The share of ids served from the cache (a hot row counts once per id): higher than
        `hit_rate` wherever the hot rows are reused within a batch."""
        looked_up = self.id_hits + self.id_misses
        return self.id_hits / looked_up if looked_up else 0.0


# `map_ids`' parts, timed on the host: the whole call; the wait for and copy of the last batch's
# evictions into the host table; the choice of victims; their rows gathered on the device (queued);
# the missing rows gathered on the host and copied into the cache.
PHASES = ("map_ids", "complete_write_backs", "victims", "start_write_back", "load_copy")


class TableTier:
    """The host tier of one table: its host rows, the cache's slot map, the eviction policy, counters.

    The cache itself is the kernel's storage of this table ([cached_rows, dim] and its state): each
    call that copies rows is handed its views (`cache`), so a copied kernel (deepcopy) copies its own."""

    def __init__(self, name: str, params: HostTierParams, host: Rows) -> None:
        self.name = name  # the user's table name (messages)
        self.params = params
        self.host = host
        slots = params.cached_rows
        self.slots = SlotMap(params.rows, slots)
        self.policy = EvictionPolicy(params.algorithm, params.rows, slots)
        self.counters = CacheCounters()
        self._dirty = np.zeros(slots, np.bool_)  # slots an update may have changed since they were loaded
        self._flight = np.zeros(slots, np.bool_)  # slots of batches whose update has not run (in flight)
        self._flight_step = -1  # the stack's step count when they were mapped
        self._reread_at: int | None = None  # flushed with rows in flight at this step count (`flush`)
        self._pending: list[PendingWriteBack] = []  # evictions' write-backs started, not on the host yet
        self._scratch = np.empty(slots, np.int64)  # `_distinct`'s, one entry per slot

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sec = self.counters.seconds
            sec[phase] = sec.get(phase, 0.0) + time.perf_counter() - t0

    # -- a batch ---------------------------------------------------------------------------------
    def map_ids(self, ids: np.ndarray, step: int, grad: bool, cache: Rows) -> np.ndarray:
        """The cache slot of every id (int64, in [0, rows), checked by the caller), after loading the
        rows missing. step: the table's stack step count now; grad: the batch's update will run."""
        with self._timed("map_ids"):
            return self._map_ids(ids, step, grad, cache)

    def _map_ids(self, ids: np.ndarray, step: int, grad: bool, cache: Rows) -> np.ndarray:
        with self._timed("complete_write_backs"):
            self.complete_write_backs()  # the last batch's evictions: its step is queued by now
        self._reread_flight(step, cache)
        if self._flight_step != step:  # the stack stepped: earlier batches' updates have run
            self._flight[:] = False
        # Work in the batch's ids, not the table's rows or the cache's slots: each id's slot (the slot
        # map's gather), the cached ones' distinct slots (`_distinct`), and the missing rows alone
        # sorted and made distinct (np.unique of the whole batch cost 13 ms of a 16,384 x 8 batch's 25).
        ids = ids.reshape(-1)
        slots = self.slots.slot_of[ids].astype(np.int64)
        missing = slots == EMPTY
        kept = self._distinct(slots[~missing])  # the cached rows the batch uses: never victims
        loads, inverse = np.unique(ids[missing], return_inverse=True)
        if kept.size + loads.size > self.params.cached_rows:
            self._refuse(kept.size + loads.size)
        loaded = self._load(loads, kept, cache) if loads.size else loads
        slots[missing] = loaded[inverse.reshape(-1)]
        touched = np.concatenate([kept, loaded])
        counts = np.bincount(slots, minlength=self.params.cached_rows)[touched] if self.policy.uses.size else None
        self.policy.touch(self.slots.row_of[touched], counts, touched)
        if grad:
            self._dirty[touched] = True
            self._flight[touched] = True
            self._flight_step = step
        c = self.counters
        c.batches, c.hits, c.misses = c.batches + 1, c.hits + kept.size, c.misses + loads.size
        missed_ids = int(missing.sum())
        c.id_hits, c.id_misses = c.id_hits + int(ids.size) - missed_ids, c.id_misses + missed_ids
        return slots

    def _distinct(self, slots: np.ndarray) -> np.ndarray:
        """The distinct values of `slots` (cache slots, repeats allowed), in O(len): each position
        written into a per-slot scratch, and the positions that read themselves back are one per slot
        (whichever write of a repeated slot landed)."""
        pos = np.arange(slots.size)
        self._scratch[slots] = pos
        return slots[self._scratch[slots] == pos]

    def _refuse(self, distinct: int) -> NoReturn:
        p = self.params
        raise UserError(
            f"table {self.name!r} on the host tier: a batch needs {distinct} distinct rows but its cache "
            f"holds {p.cached_rows} (load_factor {p.load_factor:g} of {p.rows} rows); raise "
            f"cache_params.load_factor to at least {distinct / max(p.rows, 1):.3g} or make the batch smaller"
        )

    def _load(self, rows: np.ndarray, keep: np.ndarray, cache: Rows) -> np.ndarray:
        """Slots for `rows` (none cached), their rows and state copied in; `keep`: the batch's cached
        slots, never evicted."""
        free = self.slots.free()
        short = rows.size - free.size
        if short > 0:
            with self._timed("victims"):
                victims = self._victims(keep, short)
            with self._timed("start_write_back"):
                self._pending += self._write_back(victims, cache, start_only=True)
            self.slots.release(victims)
            self.counters.evictions += victims.size
            free = np.concatenate([free, victims])
        target = free[: rows.size]
        with self._timed("load_copy"):
            copy_rows(self.host, torch.from_numpy(rows), cache, torch.from_numpy(target))
        self.slots.assign(rows, target)
        self._dirty[target] = False
        self._flight[target] = False
        return target

    def _victims(self, keep: np.ndarray, k: int) -> np.ndarray:
        """k occupied slots outside `keep`, rows in flight only when nothing else is left."""
        if self.policy.queue is not None:  # LRU: from the front of its queue, O(victims)
            kept = np.zeros(self.params.cached_rows, np.bool_)
            kept[keep] = True
            return self.policy.queue.oldest(k, self.slots.row_of, kept, self._flight)
        movable = np.ones(self.params.cached_rows, np.bool_)
        movable[keep] = False
        movable &= self.slots.row_of != EMPTY
        settled = np.flatnonzero(movable & ~self._flight)
        chosen = self.policy.victims(settled, self.slots.row_of, k)
        if chosen.size < k:  # (the previous batch's forward never got its backward, or two forwards share one)
            flying = np.flatnonzero(movable & self._flight)
            chosen = np.concatenate([chosen, self.policy.victims(flying, self.slots.row_of, k - chosen.size)])
        return chosen

    def _write_back(self, slots: np.ndarray, cache: Rows, start_only: bool = False) -> list[PendingWriteBack]:
        """The rows in `slots` that an update may have changed, copied to the host with their state;
        `start_only`: a device's part only, the rest returned to complete (module docstring)."""
        changed = slots[self._dirty[slots]]
        if changed.size == 0:
            return []
        src, dst = torch.from_numpy(changed), torch.from_numpy(self.slots.row_of[changed])
        self._dirty[changed] = False
        self.counters.writebacks += changed.size
        if start_only:
            return start_copy_rows(cache, src, self.host, dst)
        copy_rows(cache, src, self.host, dst)
        return []

    def complete_write_backs(self) -> None:
        """The started write-backs' rows into the host table (each chunk waits for its gather)."""
        pending, self._pending = self._pending, []
        for chunk in pending:
            chunk.complete()

    # -- the whole table ---------------------------------------------------------------------------
    def flush(self, step: int, cache: Rows) -> None:
        """Make the host table whole (every changed row written back) and empty the cache, except the
        rows in flight (module docstring); `step`: the table's stack step count now."""
        self.complete_write_backs()
        occupied = self.slots.occupied()
        if occupied.size == 0:
            return
        self._write_back(occupied, cache)
        in_flight = self._flight if self._flight_step == step else np.zeros_like(self._flight)
        self.slots.release(occupied[~in_flight[occupied]])
        if in_flight.any():
            self._dirty[in_flight] = True  # their update is still to come
            self._reread_at = step
        self.counters.flushes += 1

    def _reread_flight(self, step: int, cache: Rows) -> None:
        """After a flush that kept rows in flight: no update ran since (same step count), so the host
        holds their values, perhaps loaded since: read them again."""
        if self._reread_at is None:
            return
        if self._reread_at == step:
            kept = self.slots.occupied()
            # (still dirty: the update of the forward in flight may yet come, as with gradients accumulated)
            copy_rows(self.host, torch.from_numpy(self.slots.row_of[kept]), cache, torch.from_numpy(kept))
        self._reread_at = None

    def cached_rows(self) -> np.ndarray:
        """The table rows the cache holds now (increasing slot order)."""
        return self.slots.row_of[self.slots.occupied()]
