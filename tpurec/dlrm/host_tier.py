"""`tpurec train --host-tier`: tables kept in host memory behind a cache of their rows (docs/host_tier.md).

    tpurec train --host-tier t_C3:0.2:lru,t_C10:0.1

Each named table goes to the planner in TorchRec's words (`fused_uvm_caching` with its CacheParams,
tpurec/planner/host_tier_flag.py), merged into the model's own constraints; the run's result line then
reports each host-tier table's cache: hits, misses, evictions and the hit rate (distinct rows per
batch, summed over the run's training and evaluation batches and over the ranks). CPU ranks and the
TPU path (the caches on the device; run on the emulated TPU so far); `auto` is `tpurec plan`'s: on CPU
ranks both tiers share the rank's memory, so the planner has nothing to gain by moving a table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.planner import host_tier_flag

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints

FLAG = "--host-tier"
COUNTERS = ("hits", "misses", "evictions", "writebacks", "rows", "cache_rows", "id_hits", "id_misses")


def problem(text: str | None, *, plan: str | None, zch: bool, tpu: bool = False) -> str | None:
    """Why `--host-tier text` cannot run with the other options (one line), or None. tpu: the run's
    device is a TPU (real or emulated), where `auto` may move tables off its HBM."""
    if text is None:
        return None
    try:
        tables = host_tier_flag.parse(text, FLAG)
    except ValueError as e:
        return str(e)
    if tables == host_tier_flag.AUTO and not tpu:
        return (
            f"{FLAG} auto moves tables off a TPU's HBM (--device tpu, or tpurec plan for a slice); a CPU rank keeps "
            f"both tiers in one memory: name the tables ({FLAG} TABLE[:LOAD_FACTOR[:lru|lfu]],...)"
        )
    if plan:
        return f"{FLAG} plans the tables onto the host tier; --plan {plan} holds its own (its cache_params): give one"
    if zch:
        return f"{FLAG}: --zch's managed-collision tables are not on the host tier yet; leave out one of them"
    return None


def is_auto(text: str | None) -> bool:
    """`--host-tier auto`: the planner chooses the tables (DMP's host_tier="auto")."""
    return text is not None and host_tier_flag.parse(text, FLAG) == host_tier_flag.AUTO


def planned_tables(plan: Any) -> list[str]:
    """The tables a ShardingPlan keeps on the host tier (those given cache_params by the planner)."""
    from tpurec.planner.host_tier_choice import host_tier_tables
    from tpurec.planner.plan_check import module_plans

    return sorted({name for module in module_plans(plan).values() for name in host_tier_tables(module)})


def constraints(
    text: str, names: list[str], base: dict[str, ParameterConstraints] | None
) -> dict[str, ParameterConstraints]:
    """`base` with the tables of `--host-tier text` on the host tier (refused unless they are `names`)."""
    tables = host_tier_flag.parse(text, FLAG)
    assert isinstance(tables, list)  # (`problem` refused auto and off before the run)
    host_tier_flag.check_tables(tables, names, FLAG)
    return host_tier_flag.with_host_tier(base, tables)


def _tiers(dmp: nn.Module) -> list[Any]:
    """Every host-tier table shard of this rank (embedding/host_tier/table_tier.py's TableTier)."""
    from tpurec.dlrm.input_pipeline import sparsecore_lookups

    return [t for m in sparsecore_lookups(dmp) for t in (getattr(m.kernel, "host_tier", None) or {}).values()]


def figures(dmp: nn.Module, tables: list[str], world_size: int) -> dict[str, dict[str, Any]]:
    """{table: its cache's figures over every shard and rank} (a collective when world_size > 1)."""
    import torch

    counts = torch.zeros(len(tables), len(COUNTERS), dtype=torch.int64)
    algorithm: dict[str, str] = {}
    for tier in _tiers(dmp):
        c = tier.counters
        p = tier.params
        row = (c.hits, c.misses, c.evictions, c.writebacks, p.rows, p.cached_rows, c.id_hits, c.id_misses)
        counts[tables.index(tier.name)] += torch.tensor(row, dtype=torch.int64)
        algorithm[tier.name] = tier.params.algorithm.name.lower()
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(counts)
    out: dict[str, dict[str, Any]] = {}
    for name, row in zip(tables, counts.tolist()):
        f: dict[str, Any] = dict(zip(COUNTERS, row))
        looked_up = f["hits"] + f["misses"]
        f["hit_rate"] = round(f["hits"] / looked_up, 6) if looked_up else None  # of a batch's distinct rows
        ids = f["id_hits"] + f["id_misses"]
        f["id_hit_rate"] = round(f["id_hits"] / ids, 6) if ids else None  # of the ids (a hot row: once an id)
        f["algorithm"] = algorithm.get(name)
        out[name] = f
    return out


def table_names(text: str | None, plan: str | None) -> list[str]:
    """The tables a run keeps on the host tier: --host-tier's, or those its --plan gives cache_params."""
    if text is not None:
        tables = host_tier_flag.parse(text, FLAG)
        return [t.name for t in tables] if isinstance(tables, list) else []
    if plan is None:
        return []
    from tpurec.planner.plan_io import plan_from_dict, read_doc

    return planned_tables(plan_from_dict(read_doc(plan), source=f"--plan {plan}"))


def summary(figures: dict[str, dict[str, Any]]) -> str:
    """One line for the log: each table's hit rate and counts."""
    parts = [
        f"{name} {f['hit_rate']:.1%} ({f['hits']:,} hits, {f['misses']:,} misses, {f['evictions']:,} evictions; "
        f"cache {f['cache_rows']:,} of {f['rows']:,} rows, {f['algorithm']})"
        if f["hit_rate"] is not None
        else f"{name}: no lookups"
        for name, f in figures.items()
    ]
    return "host tier: " + "; ".join(parts)
