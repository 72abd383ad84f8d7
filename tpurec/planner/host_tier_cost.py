"""What a shard on the host tier costs (docs/host_tier.md): its cache on the device, the whole shard
in host memory, and the copies of the rows its cache misses.

On the device a host-tier shard is a table of `C` rows, its cache (C = ceil(load factor x the shard's
rows), at least one: tpurec.embedding.host_tier.params), counted as any table of C rows is (padded
rows, optimizer state, buffers, activations, the update's transient): the ids and so the lookup and
update times are the resident shard's. In host memory: every row of the shard and its optimizer
state, unpadded (host_rows.py allocates [rows, dim] and the state). The copies: each row a batch
misses is loaded with its state, and a victim written back with its state, over the host link.

The hit rate comes from the table's hot-row curve (`tpurec data stats`, hit_rate.py) when there is
one; without one it is unknown (reported as none), and the copies are priced at the worst case, every
id of the shard's batch a miss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tpurec.embedding.host_tier.params import host_tier_params
from tpurec.embedding.optimizers.registry import spec_class
from tpurec.planner.hit_rate import CacheEstimate, estimate

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams

    from tpurec.planner.hot_rows import HotRows
    from tpurec.planner.shard_costs import ShardCost

# The host link a device's misses cross (PCIe): 16 GB/s each way, a guess (no per-chip figure read).
HOST_LINK_BYTES_PER_S = 16 * 10**9


@dataclass(frozen=True)
class HostTierShard:
    """One shard's host tier as the planner sees it."""

    rows: int  # the shard's rows, all in host memory
    cached_rows: int  # its cache on the device
    load_factor: float
    algorithm: str  # "lru" / "lfu"


def host_tier_shard(table: str, rows: int, cache: CacheParams) -> HostTierShard:
    p = host_tier_params(table, rows, cache)
    return HostTierShard(rows, p.cached_rows, p.load_factor, p.algorithm.name.lower())


def host_bytes(rows: int, cols: int, elem_bytes: int, optimizer: str) -> int:
    """A shard's rows and their optimizer state in host memory (float32 state, as the kernel's)."""
    return rows * (cols * elem_bytes + spec_class(optimizer).state_bytes_per_row(cols))


def table_estimate(
    curve: HotRows | None, cached_rows: int, samples_per_batch: int, algorithm: str
) -> CacheEstimate | None:
    """The whole table's cache (all its shards' rows together) over a global batch: None without a curve."""
    if curve is None:
        return None
    return estimate(curve, cached_rows, samples_per_batch * curve.ids_per_sample, algorithm)


def host_tier_cost(
    resident: Callable[..., ShardCost],
    shard: HostTierShard,
    *,
    cols: int,
    elem_bytes: int,
    optimizer: str,
    misses_per_batch: float,
) -> ShardCost:
    """The cost of a host-tier shard: `resident(rows=C)` of its C cache rows (a resident shard of that
    many rows), its host bytes, and its copies: `misses_per_batch` rows loaded and as many written back."""
    device = resident(rows=shard.cached_rows)
    row_bytes = cols * elem_bytes + spec_class(optimizer).state_bytes_per_row(cols)
    return replace(
        device,
        host=host_bytes(shard.rows, cols, elem_bytes, optimizer),
        host_ms=2 * misses_per_batch * row_bytes / HOST_LINK_BYTES_PER_S * 1e3,
    )


def shard_misses(estimate: CacheEstimate | None, shard_rows: int, table_rows: int, shard_ids: float) -> float:
    """A shard's misses a batch: its rows' share of the table's expected misses, or without an estimate
    the worst case, every one of the shard's ids a batch."""
    if estimate is None:
        return shard_ids
    return estimate.misses_per_batch * shard_rows / max(1, table_rows)


def host_tier_shard_cost(
    resident: Callable[..., ShardCost],
    *,
    table: str,
    table_rows: int,
    shard_rows: int,
    cols: int,
    cache: CacheParams,
    elem_bytes: int,
    optimizer: str,
    curve: HotRows | None,
    samples: int,
    shard_ids: float,
) -> ShardCost:
    """A host-tier shard of `shard_rows` x `cols` of `table` (`table_rows` rows; hot-row `curve` or
    None), `samples` a global batch, `shard_ids` the shard's ids a batch; `resident(rows=n)` the cost of
    a resident shard of `rows` rows (its cache)."""
    shard = host_tier_shard(table, shard_rows, cache)
    whole = host_tier_shard(table, table_rows, cache)  # the model's figure: the table as one cache
    est = table_estimate(curve, whole.cached_rows, samples, shard.algorithm)
    return host_tier_cost(
        resident,
        shard,
        cols=cols,
        elem_bytes=elem_bytes,
        optimizer=optimizer,
        misses_per_batch=shard_misses(est, shard_rows, table_rows, shard_ids),
    )
