"""LRU and LFU victim choice."""

from __future__ import annotations

import numpy as np
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

from tpurec.embedding.host_tier.policy import EvictionPolicy


def _slots(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def test_lru_evicts_the_slots_used_longest_ago():
    policy = EvictionPolicy(CacheAlgorithm.LRU, rows=10, slots=4)
    row_of = _slots(5, 6, 7, 8)  # slot s holds row 5 + s
    policy.touch(_slots(5, 6), _slots(9, 9), _slots(0, 1))  # batch 1: slots 0, 1 (used 9 times each)
    policy.touch(_slots(7), _slots(1), _slots(2))  # batch 2: slot 2
    policy.touch(_slots(8), _slots(1), _slots(3))  # batch 3: slot 3
    policy.touch(_slots(5), _slots(1), _slots(0))  # batch 4: slot 0 again
    # recency alone: slot 1 (batch 1), then 2 (batch 2); use counts do not matter
    assert sorted(policy.victims(_slots(0, 1, 2, 3), row_of, 2)) == [1, 2]
    assert list(policy.victims(_slots(0, 3), row_of, 1)) == [3]


def test_lfu_evicts_the_rows_used_least_then_the_least_recent():
    policy = EvictionPolicy(CacheAlgorithm.LFU, rows=10, slots=4)
    row_of = _slots(5, 6, 7, 8)
    policy.touch(_slots(5, 6, 7, 8), _slots(3, 1, 1, 2), _slots(0, 1, 2, 3))  # batch 1: every slot
    policy.touch(_slots(7), _slots(1), _slots(2))  # batch 2: row 7 again (2 uses)
    # rows 6 (1 use) then 7 and 8 (2 uses each: 8's last use is older), row 5 (3 uses) last
    assert list(policy.victims(_slots(0, 1, 2, 3), row_of, 1)) == [1]
    assert sorted(policy.victims(_slots(0, 1, 2, 3), row_of, 2)) == [1, 3]
    assert sorted(policy.victims(_slots(0, 1, 2, 3), row_of, 3)) == [1, 2, 3]


def test_lfu_counts_follow_the_row_out_of_the_cache_and_back():
    policy = EvictionPolicy(CacheAlgorithm.LFU, rows=10, slots=2)
    policy.touch(_slots(1), _slots(5), _slots(0))  # row 1: 5 uses, in slot 0
    policy.touch(_slots(2), _slots(1), _slots(0))  # row 1 evicted; row 2 (1 use) in slot 0
    policy.touch(_slots(3), _slots(2), _slots(1))  # row 3 (2 uses) in slot 1
    policy.touch(_slots(1), _slots(1), _slots(0))  # row 1 back in slot 0: 6 uses, not 1
    assert list(policy.victims(_slots(0, 1), _slots(1, 3), 1)) == [1]  # row 3 (2 uses) goes, row 1 stays


def test_asking_for_every_candidate_returns_them_all():
    policy = EvictionPolicy(CacheAlgorithm.LRU, rows=4, slots=3)
    assert list(policy.victims(_slots(0, 2), _slots(0, 1, 2), 5)) == [0, 2]
