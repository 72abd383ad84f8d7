"""LRU's victims from its queue (tpurec/embedding/host_tier/lru_queue.py): the slots used longest ago,
as sorting every slot's last use would choose them, without looking at every slot."""

from __future__ import annotations

import numpy as np
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

from tpurec.embedding.host_tier.policy import EvictionPolicy
from tpurec.embedding.host_tier.slot_map import EMPTY

SLOTS = 64


def _mask(*slots: int) -> np.ndarray:
    m = np.zeros(SLOTS, np.bool_)
    m[list(slots)] = True
    return m


def test_random_batches_evict_the_least_recently_used_slots():
    # each round: a batch uses some slots; k victims outside its own; their last uses must be the k
    # oldest of the candidates' (equal ones in any order), as the sort over every slot gives them
    rng = np.random.default_rng(0)
    policy = EvictionPolicy(CacheAlgorithm.LRU, rows=1000, slots=SLOTS)
    assert policy.queue is not None
    row_of = np.arange(SLOTS, dtype=np.int64)  # every slot occupied
    policy.touch(row_of, None, np.arange(SLOTS))
    none = _mask()
    for _ in range(300):
        used = rng.choice(SLOTS, rng.integers(1, 20), replace=False)
        kept = _mask(*used)
        k = int(rng.integers(1, 10))
        before = policy.last_used.copy()
        chosen = policy.queue.oldest(k, row_of, kept, none)
        candidates = np.flatnonzero(~kept)
        want = np.sort(before[candidates])[:k]
        assert np.array_equal(np.sort(before[chosen]), want) and not kept[chosen].any()
        assert len(set(chosen.tolist())) == k
        policy.touch(row_of[used], None, used)  # the batch's own slots used now
        policy.touch(row_of[chosen], None, chosen)  # the victims refilled with rows the batch loaded


def test_rows_in_flight_go_last_and_stay_queued_when_spared():
    policy = EvictionPolicy(CacheAlgorithm.LRU, rows=100, slots=SLOTS)
    assert policy.queue is not None
    row_of = np.full(SLOTS, EMPTY, np.int64)
    row_of[:4] = [10, 11, 12, 13]
    policy.touch(row_of[[0, 1]], None, np.array([0, 1]))  # batch 1: slots 0, 1 (in flight below)
    policy.touch(row_of[[2, 3]], None, np.array([2, 3]))  # batch 2: slots 2, 3
    flight = _mask(0, 1)
    assert list(policy.queue.oldest(2, row_of, _mask(), flight)) == [2, 3]  # older, but in flight: spared
    policy.touch(row_of[[2, 3]], None, np.array([2, 3]))  # batch 3 refills 2, 3
    # nothing else left: the rows in flight, oldest first, their entries still in the queue
    assert list(policy.queue.oldest(3, row_of, _mask(2), flight)) == [3, 0, 1]
    policy.touch(row_of[[2]], None, np.array([2]))  # batch 4 used its own slot 2 ...
    policy.touch(row_of[[3]], None, np.array([3]))  # ... and batch 5 refilled slot 3
    row_of[[0, 1]] = EMPTY  # released (a flush): no longer victims
    assert list(policy.queue.oldest(2, row_of, _mask(), _mask())) == [2, 3]


def test_a_queue_of_stale_entries_is_rebuilt_in_last_use_order():
    # a hot slot used every batch leaves a stale entry each time; past four times the cache the queue
    # is rebuilt from the last uses alone, and evicts as before
    policy = EvictionPolicy(CacheAlgorithm.LRU, rows=100, slots=SLOTS)
    queue = policy.queue
    assert queue is not None
    row_of = np.arange(SLOTS, dtype=np.int64)
    policy.touch(row_of, None, np.arange(SLOTS))
    for _ in range(1000):
        policy.touch(row_of[[5, 6, 7]], None, np.array([5, 6, 7]))
    assert queue._size <= 4 * SLOTS + 1024 and len(queue._entries) < 1000  # rebuilt on the way
    chosen = queue.oldest(SLOTS - 3, row_of, _mask(), _mask())
    assert sorted(chosen.tolist()) == sorted(set(range(SLOTS)) - {5, 6, 7})  # the hot ones last
