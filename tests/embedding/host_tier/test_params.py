"""The cache's size and eviction from TorchRec's CacheParams."""

from __future__ import annotations

import math

import pytest
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.types import CacheParams

from tpurec.embedding.host_tier.params import DEFAULT_LOAD_FACTOR, host_tier_params
from tpurec.errors import UserError


@pytest.mark.parametrize(
    ("rows", "load_factor", "cached"),
    [
        (1000, 0.1, 100),
        (300, 0.1, 30),  # 0.1 * 300 is 30.000000000000004 in floating point: still 30 rows
        (7, 0.15, 2),  # 1.05 rows, rounded up
        (10, 0.001, 1),  # at least one row
        (7, 1.0, 7),  # the whole table
        (0, 0.5, 0),  # an empty row-wise shard caches nothing
    ],
)
def test_the_cache_holds_the_load_factor_of_the_rows_rounded_up(rows, load_factor, cached):
    p = host_tier_params("t", rows, CacheParams(load_factor=load_factor, algorithm=CacheAlgorithm.LFU))
    assert (p.rows, p.cached_rows, p.load_factor, p.algorithm) == (rows, cached, load_factor, CacheAlgorithm.LFU)


def test_fields_left_out_are_fbgemms_defaults():
    for given in (None, CacheParams()):
        p = host_tier_params("t", 1000, given)
        assert (p.load_factor, p.algorithm) == (DEFAULT_LOAD_FACTOR, CacheAlgorithm.LRU)
        assert p.cached_rows == math.ceil(DEFAULT_LOAD_FACTOR * 1000)


@pytest.mark.parametrize("load_factor", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_a_load_factor_outside_0_1_is_refused_naming_the_table(load_factor):
    with pytest.raises(UserError, match=r"^table 'big': cache_params.load_factor must be a number in \(0, 1\]") as e:
        host_tier_params("big", 1000, CacheParams(load_factor=load_factor))
    assert "\n" not in str(e.value)


def test_an_algorithm_other_than_lru_or_lfu_is_refused():
    with pytest.raises(UserError, match="table 'big': cache_params.algorithm must be CacheAlgorithm.LRU or LFU"):
        host_tier_params("big", 1000, CacheParams(algorithm="lru"))
