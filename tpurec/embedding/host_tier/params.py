"""How big a table's cache is and how it evicts: TorchRec's CacheParams read for the host tier.

TorchRec says it per table with `ParameterConstraints(compute_kernels=["fused_uvm_caching"],
cache_params=CacheParams(load_factor, algorithm))`: the cache holds `load_factor` of the table's rows
(FBGEMM's meaning of the load factor; rounded up, at least one row), and evicts by `algorithm`
(FBGEMM's CacheAlgorithm: LRU or LFU). A load factor left out is FBGEMM's default, 0.2; an
algorithm left out, FBGEMM's default, LRU. CacheParams' other fields (precision, reserved memory,
prefetch pipeline, statistics) are about FBGEMM's CUDA cache and its planner: not read here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.types import CacheParams

from tpurec.errors import UserError

DEFAULT_LOAD_FACTOR = 0.2  # FBGEMM's `cache_load_factor` default (SplitTableBatchedEmbeddingBagsCodegen)
ALGORITHMS = (CacheAlgorithm.LRU, CacheAlgorithm.LFU)


@dataclass(frozen=True)
class HostTierParams:
    """One table's (or shard's) host tier: all its rows on the host, `cached_rows` of them in the cache."""

    rows: int
    cached_rows: int
    load_factor: float
    algorithm: CacheAlgorithm


def host_tier_params(table: str, rows: int, cache: CacheParams | None) -> HostTierParams:
    """The host tier of `table` (named in messages) with `rows` rows, from its CacheParams (None: defaults)."""
    cache = cache or CacheParams()
    load_factor = DEFAULT_LOAD_FACTOR if cache.load_factor is None else cache.load_factor
    if not (isinstance(load_factor, (int, float)) and math.isfinite(load_factor) and 0 < load_factor <= 1):
        raise UserError(
            f"table {table!r}: cache_params.load_factor must be a number in (0, 1] (the share of rows the "
            f"cache holds), got {load_factor!r}"
        )
    algorithm = CacheAlgorithm.LRU if cache.algorithm is None else cache.algorithm
    if algorithm not in ALGORITHMS:
        raise UserError(f"table {table!r}: cache_params.algorithm must be CacheAlgorithm.LRU or LFU, got {algorithm!r}")
    # rounded first: 0.1 * 300 is 30.000000000000004 in floating point, which is 30 rows, not 31
    cached = min(rows, max(1, math.ceil(round(load_factor * rows, 6))))
    return HostTierParams(rows, cached, float(load_factor), algorithm)
