"""One table's cache: slots, loads, write-backs, pins, flushes, on small tensors (no kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

from tpurec.embedding.host_tier.host_rows import Rows
from tpurec.embedding.host_tier.params import HostTierParams
from tpurec.embedding.host_tier.table_tier import TableTier
from tpurec.errors import UserError

ROWS, DIM, SLOTS = 10, 2, 4


def _tier() -> tuple[TableTier, Rows]:
    """A 10-row table (row r holds r, r + 0.5; its state r / 10) and an empty 4-slot cache."""
    weight = torch.stack([torch.arange(ROWS) + 0.0, torch.arange(ROWS) + 0.5], 1)
    host = Rows(weight, {"momentum1": torch.arange(ROWS) / 10.0})
    cache = Rows(torch.zeros(SLOTS, DIM), {"momentum1": torch.zeros(SLOTS)})
    return TableTier("emb", HostTierParams(ROWS, SLOTS, 0.4, CacheAlgorithm.LRU), host), cache


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _holds(tier: TableTier, cache: Rows, slots: np.ndarray, rows: np.ndarray) -> None:
    """The cache's slots hold exactly the host's rows (weight and state)."""
    index = torch.from_numpy(slots)
    assert torch.equal(cache.weight[index], tier.host.weight[torch.from_numpy(rows)])
    assert torch.equal(cache.states["momentum1"][index], tier.host.states["momentum1"][torch.from_numpy(rows)])


def test_a_batch_maps_to_slots_holding_its_rows_and_their_state():
    tier, cache = _tier()
    ids = _ids(3, 7, 3, 3)
    slots = tier.map_ids(ids, step=0, grad=False, cache=cache)
    assert slots.shape == ids.shape and slots[0] == slots[2] == slots[3] != slots[1]
    _holds(tier, cache, slots, ids)
    again = tier.map_ids(_ids(7, 1), step=0, grad=False, cache=cache)
    assert again[0] == slots[1]
    c = tier.counters
    assert (c.batches, c.hits, c.misses, c.evictions, c.writebacks) == (2, 1, 3, 0, 0)
    # per id: the first batch's 4 ids all missed (row 3 three times), the second's id of row 7 hit
    assert (c.id_hits, c.id_misses, c.id_hit_rate) == (1, 5, 1 / 6)
    assert c.hit_rate == 0.25


def test_rows_an_update_may_have_changed_are_written_back_when_evicted():
    tier, cache = _tier()
    first = tier.map_ids(_ids(3, 7), step=0, grad=True, cache=cache)
    cache.weight[first[0]] = torch.tensor([30.0, 30.5])  # the update of row 3 (row 7 kept its values)
    cache.states["momentum1"][first[0]] = 3.0
    second = tier.map_ids(_ids(0, 1, 2, 4), step=1, grad=False, cache=cache)  # 4 rows: 3 and 7 leave
    _holds(tier, cache, second, _ids(0, 1, 2, 4))
    assert torch.equal(tier.host.weight[3], torch.tensor([30.0, 30.5]))
    assert float(tier.host.states["momentum1"][3]) == 3.0
    assert torch.equal(tier.host.weight[7], torch.tensor([7.0, 7.5]))
    c = tier.counters
    assert (c.evictions, c.writebacks) == (2, 2)
    # rows read without gradients (an evaluation) are not written back
    tier.map_ids(_ids(5, 6, 8, 9), step=1, grad=False, cache=cache)
    assert (c.evictions, c.writebacks) == (6, 2)


def test_a_batchs_own_rows_are_never_evicted_for_it():
    tier, cache = _tier()
    tier.map_ids(_ids(0, 1, 2, 3), step=0, grad=False, cache=cache)
    tier.map_ids(_ids(9), step=0, grad=False, cache=cache)  # row 0, the least recent, made room
    slots = tier.map_ids(_ids(0, 3, 5), step=0, grad=False, cache=cache)  # 0 back, 5 new: 1 and 2 leave
    _holds(tier, cache, slots, _ids(0, 3, 5))
    assert sorted(tier.cached_rows()) == [0, 3, 5, 9]


def test_a_batch_needing_more_rows_than_the_cache_holds_is_refused():
    tier, cache = _tier()
    want = r"table 'emb' on the host tier: a batch needs 5 distinct rows but its cache holds 4 "
    with pytest.raises(UserError, match=want):
        tier.map_ids(_ids(0, 1, 2, 3, 4, 4), step=0, grad=True, cache=cache)


def test_rows_in_flight_leave_only_when_nothing_else_can():
    tier, cache = _tier()
    tier.map_ids(_ids(0, 1), step=0, grad=True, cache=cache)  # its update has not run (step still 0)
    tier.map_ids(_ids(2, 3), step=0, grad=False, cache=cache)
    tier.map_ids(_ids(4), step=0, grad=False, cache=cache)  # LRU would take row 0; in flight, 2 goes
    assert sorted(tier.cached_rows()) == [0, 1, 3, 4]
    tier.map_ids(_ids(5, 6, 7), step=0, grad=False, cache=cache)  # three to evict, only 3 and 4 settled
    assert len(set(tier.cached_rows()) & {0, 1}) == 1
    tier.map_ids(_ids(8), step=1, grad=False, cache=cache)  # the update ran: the least recent row goes
    assert sorted(tier.cached_rows()) == [5, 6, 7, 8]


def test_a_flush_writes_back_and_empties_the_cache():
    tier, cache = _tier()
    slots = tier.map_ids(_ids(2, 5), step=0, grad=True, cache=cache)
    cache.weight[slots[1]] += 100.0  # the update
    tier.flush(step=1, cache=cache)  # the stack stepped: nothing in flight
    assert len(tier.cached_rows()) == 0
    assert torch.equal(tier.host.weight[5], torch.tensor([105.0, 105.5]))
    tier.host.weight[2] = -1.0  # a checkpoint loaded into the host table in place
    again = tier.map_ids(_ids(2), step=1, grad=False, cache=cache)
    assert torch.equal(cache.weight[again[0]], torch.tensor([-1.0, -1.0]))
    assert tier.counters.flushes == 1


def test_a_flush_between_forward_and_backward_keeps_the_rows_in_flight():
    tier, cache = _tier()
    slots = tier.map_ids(_ids(2, 5), step=0, grad=True, cache=cache)
    tier.map_ids(_ids(7), step=0, grad=False, cache=cache)
    tier.flush(step=0, cache=cache)  # the update of (2, 5) is still to come: it lands in their slots
    assert sorted(tier.cached_rows()) == [2, 5]
    cache.weight[slots[0]] += 100.0  # ... it does
    tier.map_ids(_ids(1), step=1, grad=False, cache=cache)
    assert torch.equal(cache.weight[slots[0]], torch.tensor([102.0, 102.5]))  # the cache's value, the newer
    tier.flush(step=1, cache=cache)
    assert torch.equal(tier.host.weight[2], torch.tensor([102.0, 102.5]))


def test_rows_kept_in_flight_are_read_again_when_no_update_came():
    tier, cache = _tier()
    slots = tier.map_ids(_ids(2, 5), step=0, grad=True, cache=cache)  # a forward whose backward never runs
    tier.flush(step=0, cache=cache)
    tier.host.weight[5] = -5.0  # a checkpoint loaded in place
    tier.map_ids(_ids(5, 6), step=0, grad=True, cache=cache)  # still no update: the host is the truth
    assert torch.equal(cache.weight[slots[1]], torch.tensor([-5.0, -5.0]))


def test_with_the_cache_on_a_device_an_eviction_reaches_the_host_at_the_next_batch(monkeypatch):
    """The cache taken for a device's: an evicted row's write-back is gathered when it is evicted and
    copied to the host (the host's wait for the device) only when the next batch is mapped or the table
    flushed, so the host queues the current step first; a row evicted and wanted by the very next batch
    comes back with its updated values, and the host table is whole after a flush."""
    from tpurec.embedding.host_tier import device_copies
    from tpurec.runtime import host_copies

    tier, cache = _tier()
    on_cache = {t.data_ptr() for t in (cache.weight, *cache.states.values())}
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() not in on_cache)
    copies: list[tuple[int, ...]] = []
    real = host_copies.to_host
    monkeypatch.setattr(host_copies, "to_host", lambda x, what: copies.append(tuple(x.shape)) or real(x, what))

    first = tier.map_ids(_ids(3, 7, 1, 2), step=0, grad=True, cache=cache)
    cache.weight[torch.from_numpy(first)] += 100.0  # the update of batch 0
    cache.states["momentum1"][torch.from_numpy(first)] += 1.0
    tier.map_ids(_ids(3, 0, 4), step=1, grad=True, cache=cache)  # 0 and 4 evict LRU 7 and 1
    assert copies == [] and float(tier.host.weight[7, 0]) == 7.0  # gathered, not on the host yet
    assert tier.counters.writebacks == 2
    back = tier.map_ids(_ids(7, 1), step=1, grad=False, cache=cache)  # both wanted again at once
    assert copies == [(SLOTS, DIM + 1)]  # one copy (padded to the 4-slot cache) when this batch began
    assert torch.equal(cache.weight[torch.from_numpy(back)], torch.tensor([[107.0, 107.5], [101.0, 101.5]]))
    assert torch.allclose(cache.states["momentum1"][torch.from_numpy(back)], torch.tensor([1.7, 1.1]))
    tier.flush(step=1, cache=cache)
    for row in (1, 2, 3, 7):  # every updated row on the host after the flush
        assert float(tier.host.weight[row, 0]) == row + 100.0, row
