"""The planner's choice of the host tier: which tables, with what cache, when the model does not fit.

Asked for (`planners.plan(host_tier="auto")`, what `tpurec plan` does unless `--host-tier off`), a
model refused for device memory on a TPU slice is planned again with tables moved to the host tier
(docs/host_tier.md), the largest first (weights and optimizer state: the most device memory freed a
table), until a plan fits; tables the host tier does not run (an EmbeddingCollection's, a
feature-processed or managed-collision collection's) stay. Each moved table's cache is the smallest
load factor of LOAD_FACTORS whose expected hit rate (its hot-row curve from `tpurec data stats`,
hit_rate.py) reaches TARGET_HIT_RATE, else FBGEMM's default (0.2), the default too without a curve;
never smaller than a batch's distinct rows need (a batch over its cache is refused when it runs), and
a table whose batches touch more than MAX_LOAD_FACTOR of its rows is not moved (its cache would keep
most of it on the device anyway). Host memory is budgeted per device by TorchRec's partitioner
(host_memory.py); on CPU ranks both tiers share one memory, so nothing is gained there and nothing
is moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.types import CacheParams, ShardingPlan

from tpurec.embedding.host_tier.params import DEFAULT_LOAD_FACTOR, host_tier_params
from tpurec.embedding.optimizers.registry import spec_class
from tpurec.planner.host_tier_cost import host_bytes, table_estimate
from tpurec.planner.plan_errors import PlanDoesNotFit
from tpurec.planner.topology import format_bytes

if TYPE_CHECKING:
    from torch import nn
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig

    from tpurec.planner.hot_rows import HotRows

AUTO = "auto"
LOAD_FACTORS = (0.01, 0.02, 0.05, 0.1, DEFAULT_LOAD_FACTOR)
TARGET_HIT_RATE = 0.9
# a batch's distinct rows over the cache, kept below: the batch would be refused (table_tier.py)
BATCH_MARGIN = 1.25
MAX_LOAD_FACTOR = 0.5
# plans tried once the tables moved could fit by their bytes alone (each a full planning run)
MAX_ATTEMPTS = 8


def eligible_tables(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The tables the host tier runs: an EmbeddingBagCollection's, not inside a feature-processed or
    managed-collision collection (per-id trainable weights, remaps: not on the host tier yet)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    wrapped = {
        id(sub)
        for m in module.modules()
        if isinstance(m, (FeatureProcessedEmbeddingBagCollection, BaseManagedCollisionEmbeddingCollection))
        for sub in m.modules()
    }
    return [
        c
        for m in module.modules()
        if isinstance(m, EmbeddingBagCollection) and id(m) not in wrapped
        for c in m.embedding_bag_configs()
    ]


def table_bytes(cfg: BaseEmbeddingConfig, optimizer: str, elem_bytes: int, rows: int | None = None) -> int:
    """Weights and optimizer state of `rows` (default all) of a table, unpadded."""
    n = cfg.num_embeddings if rows is None else rows
    return n * cfg.embedding_dim * elem_bytes + spec_class(optimizer).state_bytes(n, cfg.embedding_dim)


def lower_bounds(
    configs: list[BaseEmbeddingConfig],
    optimizer: str,
    elem_bytes: Callable[[BaseEmbeddingConfig], int],
    requests: Mapping[str, CacheParams],
    one_memory: bool,
) -> tuple[int, int]:
    """(device, host) bytes no plan can need less of: weights and state of the resident tables and of
    the host-tier tables' caches on the device; the host-tier tables whole in host memory (`one_memory`,
    CPU ranks: both in the first figure)."""
    device = host = 0
    for cfg in configs:
        if cfg.name in requests:
            cached = host_tier_params(cfg.name, cfg.num_embeddings, requests[cfg.name]).cached_rows
            device += table_bytes(cfg, optimizer, elem_bytes(cfg), cached)
            host += host_bytes(cfg.num_embeddings, cfg.embedding_dim, elem_bytes(cfg), optimizer)
        else:
            device += table_bytes(cfg, optimizer, elem_bytes(cfg))
    return (device + host, 0) if one_memory else (device, host)


def choose_cache(cfg: BaseEmbeddingConfig, curve: HotRows | None, samples: int, pooling: float) -> CacheParams | None:
    """The cache of a table moved to the host tier (LRU); None when it is not worth moving (module doc)."""
    rows = cfg.num_embeddings
    if curve is None:
        factors: tuple[float, ...] = (DEFAULT_LOAD_FACTOR,)
        distinct = min(rows, samples * pooling)  # every id a row of its own, at worst
    else:
        factors = LOAD_FACTORS
        est = table_estimate(curve, rows, samples, "lru")
        distinct = est.rows_per_batch if est is not None else float(rows)
    needed = min(1.0, math.ceil(distinct * BATCH_MARGIN) / rows)
    if needed > MAX_LOAD_FACTOR:
        return None
    chosen = factors[-1]
    for lf in factors:
        cached = host_tier_params(cfg.name, rows, CacheParams(load_factor=lf)).cached_rows
        est = table_estimate(curve, cached, samples, "lru")
        if est is not None and est.hit_rate >= TARGET_HIT_RATE:
            chosen = lf
            break
    return CacheParams(load_factor=max(chosen, round(needed, 6)), algorithm=CacheAlgorithm.LRU)


def auto_host_tier(
    configs: list[BaseEmbeddingConfig],
    attempt: Callable[[dict[str, CacheParams]], ShardingPlan],
    requests: Mapping[str, CacheParams],
    *,
    fits: Callable[[dict[str, CacheParams]], str | None],
    curves: Mapping[str, HotRows],
    samples: int,
    pooling: Mapping[str, float],
    refusal: Exception,
) -> tuple[ShardingPlan, dict[str, CacheParams]]:
    """The plan and host-tier tables of a model `attempt(requests)` refused (`refusal`): `configs`
    (eligible_tables) moved one by one, the largest first, each attempt planned once `fits(chosen)`
    (the lower bounds: None, else why not) passes. Raises the refusal, extended, when none fits."""
    order = sorted((c for c in configs if c.name not in requests), key=lambda c: -c.num_embeddings * c.embedding_dim)
    chosen, moved, attempts, why = dict(requests), [], 0, None
    for cfg in order:
        cache = choose_cache(cfg, curves.get(cfg.name), samples, pooling.get(cfg.name, 1.0))
        if cache is None:
            continue
        chosen[cfg.name] = cache
        moved.append(cfg.name)
        why = fits(chosen)
        if why is not None:
            if why.startswith("host"):  # more tables would need more host memory still
                break
            continue
        attempts += 1
        try:
            return attempt(chosen), chosen
        except PlanDoesNotFit as e:
            why = str(e)
            if attempts >= MAX_ATTEMPTS:
                break
    tried = f"{len(moved)} table(s) on the host tier ({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''})"
    raise PlanDoesNotFit(f"{refusal}; not even with {tried}: {why or 'no table the host tier runs is left'}")


def host_fit_problem(host_need: int, host_free: int) -> str | None:
    if host_need > host_free:
        return (
            f"host memory: the host-tier tables need at least {format_bytes(host_need)} of weights and optimizer "
            f"state against {format_bytes(host_free)} of host memory free on the whole slice"
        )
    return None
