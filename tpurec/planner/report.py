"""Plan inspector: per-table and per-device HBM and time of a ShardingPlan, as a dict, text or diff.

The numbers come from the same `shard_cost` the planner optimised, so what is printed is what the
planner believed. `build_report` returns the JSON document of `tpurec plan --format json`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable

from tpurec.data.catalog import TableSpec
from tpurec.embedding import dtypes
from tpurec.errors import UserError
from tpurec.planner.estimators import ROW_WISE, ShardCost, shard_cost, table_elem_bytes
from tpurec.planner.host_tier_cost import host_tier_shard, host_tier_shard_cost, table_estimate
from tpurec.planner.id_limits import IdLimits
from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.planner.plan_check import module_plans
from tpurec.planner.report_text import diff_reports, fitting_text, format_text  # noqa: F401 (re-exported)
from tpurec.planner.tensorcore_pooling import pooling_per_stack
from tpurec.planner.topology import SliceSpec
from tpurec.runtime.device import DeviceKind, tensorcore_only

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from tpurec.planner.host_tier_flag import HostTierTable
    from tpurec.planner.hot_rows import HotRows

REPORT_FORMAT = "tpurec-plan-report"


def _shards(
    ps: Any, table: TableSpec, world_size: int
) -> list[tuple[int, list[int], list[int]]]:  # ps: ParameterSharding
    """(rank, offsets, sizes) of each shard; data-parallel means a full copy on every rank."""
    if ps.sharding_spec is None:
        return [(r, [0, 0], [table.num_embeddings, table.embedding_dim]) for r in (ps.ranks or range(world_size))]
    return [(s.placement.rank(), list(s.shard_offsets), list(s.shard_sizes)) for s in ps.sharding_spec.shards]


# The per-device cost fields summed over the shards each device holds.
_COST_KEYS = ("weights", "optimizer", "buffers", "activations", "transient")


@dataclass(frozen=True)
class _Costing:
    """What costs every shard alike: the slice, the batch, the optimizer, the device, the id limits."""

    spec: SliceSpec
    batch_size: int
    optimizer: str
    compute_device: str
    limits: IdLimits | None


def build_report(
    plan: ShardingPlan,
    tables: Iterable[TableSpec],
    spec: SliceSpec,
    *,
    batch_size: int,
    optimizer: str,
    compute_device: str = "tpu",
    reserved: int = 0,
    headroom_fraction: float = 0.0,
    model: str | None = None,
    limits: IdLimits | None = None,
) -> dict:
    """The plan's report. `limits` (tpurec.planner.id_limits.IdLimits): SparseCore buffers sized
    from measured id limits; each device's `worst_case_buffers_bytes` keeps the worst case beside.
    Steps: an empty row per device, a row per table (adding its shards to their devices), the
    devices' top tables, then the summary figures around them."""
    from tpurec.planner.plan_io import plan_to_dict

    by_name = {t.name: t for t in tables}
    world = spec.world_size
    cap = spec.generation.hbm_bytes
    costing = _Costing(spec, batch_size, optimizer, compute_device, limits)
    host_cap, host_reserved = _host_memory(spec, compute_device, cap)
    devices = _empty_devices(world, cap, reserved, host_cap, host_reserved)
    rows = []
    for path, module_plan in module_plans(plan).items():
        for name, ps in module_plan.items():
            t = by_name.get(name)
            if t is None:
                raise UserError(f"plan has table {name!r} that is not among the given tables")
            rows.append(_table_row(path, ps, t, devices, costing))
    _name_top_tables(devices, rows)
    times = [d["estimated_time_ms"] for d in devices]
    used = [d["hbm_used_bytes"] for d in devices]
    mean_t = sum(times) / world
    mean_b = sum(used) / world
    # TPU only: the CPU step runs its stages one after the other
    pipelined = max(d["pipelined_time_ms"] for d in devices) if compute_device == DeviceKind.TPU else None
    gen = spec.generation
    return {
        "format": REPORT_FORMAT,
        "version": 1,
        "model": model,
        "topology": spec.name,
        "generation": gen.name,
        "compute_device": compute_device,
        "world_size": world,
        "num_slices": spec.num_slices,
        "batch_size_per_device": batch_size,
        "optimizer": optimizer,
        "fits": all(u <= cap for u in used) and all(d["host_used_bytes"] <= host_cap for d in devices),
        "estimated_step_time_ms": max(times),
        "pipelined_step_time_ms": pipelined,
        "time_imbalance": max(times) / mean_t if mean_t else 1.0,
        "hbm_imbalance": max(used) / mean_b if mean_b else 1.0,
        "assumptions": _assumptions(spec, headroom_fraction, limits),
        "tables": rows,
        "devices": devices,
        # the TensorCore kernel's pooling per stack (v5e, v4; None elsewhere): Pallas or XLA's
        "tensorcore_pooling": pooling_per_stack(by_name.values(), gen.name, batch_size * world)
        if compute_device == DeviceKind.TPU
        else None,
        "meta": _report_meta(by_name.values(), costing, model, reserved, headroom_fraction),
        "plan": plan_to_dict(plan),
    }


def _host_memory(spec: SliceSpec, compute_device: str, cap: int) -> tuple[int, int]:
    """(capacity, reserved) of each device's host memory, the host tier's (host_memory.py): a CPU
    rank's is its one memory (the host tier's rows counted in its `hbm_used_bytes` too)."""
    from tpurec.planner.host_memory import HOST_HEADROOM_FRACTION, host_bytes_per_device

    if compute_device == DeviceKind.CPU:
        return cap, 0
    host = host_bytes_per_device(spec.generation.name, spec.generation.devices_per_chip)
    return host, int(host * HOST_HEADROOM_FRACTION)


def _empty_devices(world: int, cap: int, reserved: int, host_cap: int, host_reserved: int) -> list[dict]:
    """One row per device before any shard is counted: only the reserved bytes in use."""
    return [
        dict(
            rank=r,
            hbm_used_bytes=reserved,
            hbm_capacity_bytes=cap,
            reserved_bytes=reserved,
            host_used_bytes=host_reserved,
            host_capacity_bytes=host_cap,
            host_reserved_bytes=host_reserved,
            host_tier_bytes=0,
            host_ms=0.0,
            **{f"{k}_bytes": 0 for k in _COST_KEYS},
            worst_case_buffers_bytes=0,
            estimated_time_ms=0.0,
            lookup_ms=0.0,
            update_ms=0.0,
            comm_ms=0.0,
            input_comm_ms=0.0,
            pipelined_time_ms=0.0,
        )
        for r in range(world)
    ]


def _table_row(path: str, ps: Any, t: TableSpec, devices: list[dict], costing: _Costing) -> dict:
    """Table `t`'s report row (ps: its ParameterSharding in module `path`); each of its shards'
    cost is added to the device holding it."""
    spec, batch_size, compute_device, limits = costing.spec, costing.batch_size, costing.compute_device, costing.limits
    world = spec.world_size
    shards = _shards(ps, t, world)
    dtype = dtypes.from_name(t.data_type)
    stored = dtypes.short_name(dtypes.stored_dtype(dtype, compute_device))
    total_bytes, total_ms, shard_rows, host_total = 0, 0.0, [], 0
    measured = (
        limits.max_ids(
            t.name,
            batch_size * world,
            t.pooling_factor,
            max(1, spec.generation.sparsecores),
            pooled=t.pooling != "none",
            features=len(t.feature_names),
        )
        if limits is not None
        else None
    )
    cache = ps.cache_params if ps.compute_kernel == COMPUTE_KERNEL else None  # the host tier's (host_tier_choice)
    samples = batch_size * world
    row_group = len(shards) if ps.sharding_type in ROW_WISE else 1
    curve = limits.hot_rows.get(t.name) if limits is not None else None
    for rank, offsets, sizes in shards:
        cost = functools.partial(
            shard_cost,
            sharding_type=ps.sharding_type,
            cols=sizes[1],
            pooling_factor=t.pooling_factor,
            batch_per_device=batch_size,
            world_size=world,
            num_shards=len(shards),
            spec=spec,
            optimizer=costing.optimizer,
            elem_bytes=table_elem_bytes(dtype, compute_device),
            num_features=len(t.feature_names),
            weighted=t.weighted,
            pooled=t.pooling != "none",
        )
        c = cost(rows=sizes[0], max_ids_per_partition=measured)
        if cache is not None:
            c = host_tier_shard_cost(
                functools.partial(cost, max_ids_per_partition=measured),
                table=t.name,
                table_rows=t.num_embeddings,
                shard_rows=sizes[0],
                cols=sizes[1],
                cache=cache,
                elem_bytes=table_elem_bytes(dtype, compute_device),
                optimizer=costing.optimizer,
                curve=curve,
                samples=samples,
                shard_ids=samples * t.pooling_factor / row_group,
            )
        worst = cost(rows=sizes[0]).buffers if measured else c.buffers
        _add_shard(devices[rank], c, worst_case_buffers=worst, one_memory=compute_device == DeviceKind.CPU)
        total_bytes += c.bytes
        total_ms += c.time_ms
        host_total += c.host
        shard_rows.append(
            {"rank": rank, "offsets": offsets, "sizes": sizes, "bytes": c.bytes, "time_ms": c.time_ms}
            | ({"host_bytes": c.host} if cache is not None else {})
        )
    return {
        "name": t.name,
        "module": path,
        "rows": t.num_embeddings,
        "dim": t.embedding_dim,
        "pooling_factor": t.pooling_factor,
        "features": t.feature_names,
        "pooling": t.pooling,
        "weighted": t.weighted,
        "data_type": t.data_type,
        "stored_as": stored,  # differs where the device widens the table (bytes counted so)
        "note": None
        if stored == t.data_type
        else f"{t.data_type} stored as {stored} on {compute_device}: {dtypes.WIDEN_REASON}",
        "sharding_type": ps.sharding_type,
        "compute_kernel": ps.compute_kernel,
        "ranks": list(dict.fromkeys(s[0] for s in shards)),  # in shard order
        "bytes": total_bytes,
        "time_ms": total_ms,
        "shards": shard_rows,
        **tier_fields(t, cache, shards, curve, samples, host_total),
    }


def _add_shard(d: dict, c: ShardCost, worst_case_buffers: int, one_memory: bool = False) -> None:
    """Add one shard's cost `c` to device row `d`; `one_memory` (CPU ranks): its host-tier rows are in
    the device's memory too."""
    d["worst_case_buffers_bytes"] += worst_case_buffers
    for k in _COST_KEYS:
        d[f"{k}_bytes"] += getattr(c, k)
    d["hbm_used_bytes"] += c.bytes + (c.host if one_memory else 0)
    d["host_tier_bytes"] += c.host
    d["host_used_bytes"] += c.host
    d["host_ms"] += c.host_ms
    d["lookup_ms"] += c.lookup_ms
    d["update_ms"] += c.update_ms
    d["comm_ms"] += c.comm_ms
    d["input_comm_ms"] += c.input_comm_ms
    d["estimated_time_ms"] += c.time_ms
    d["pipelined_time_ms"] = pipelined_ms(d)


def pipelined_ms(d: dict) -> float:
    """A device's embedding time per step when its stages overlap, as in a pipelined step (TorchRec's
    SparseCoreTrainPipeline, tpurec's pipelined step): the SparseCore's work (lookups of one batch and
    the fused update of another, one after the other on the same cores), the device collectives of the
    pooled embeddings and their gradients (ICI, while the SparseCores work) and the ids' input dist
    (on the host, batches ahead) run side by side; the longest of the three is the step. An
    assumption, not a measurement (not yet run on TPU hardware): it holds when the compiler overlaps
    collectives with SparseCore work, and the TensorCore's dense model (not modelled) is shorter."""
    sparsecore = d["lookup_ms"] + d["update_ms"]
    collectives = d["comm_ms"] - d["input_comm_ms"]
    # the host tier's row copies: on the host link, beside the rest (a pipelined host tier: docs/host_tier.md)
    return max(sparsecore, collectives, d["input_comm_ms"], d.get("host_ms", 0.0))


def _assumptions(spec: SliceSpec, headroom_fraction: float, limits: IdLimits | None) -> dict:
    """The report's "assumptions": the bandwidths and fractions its figures rest on."""
    gen = spec.generation
    return {
        "sc_gather_fraction_of_hbm_bw": spec.sc_gather_fraction,
        "sc_gather_bw_bytes_per_s": gen.hbm_bw * spec.sc_gather_fraction,
        # how lookups and updates are priced: bytes at the SparseCore's share of HBM bandwidth, or
        # the TensorCore kernel's per-id costs measured on a v5e chip (tensorcore_cost)
        "kernel_time": "tensorcore-measured" if tensorcore_only(gen.name) else "sparsecore-bandwidth",
        "hbm_bw_bytes_per_s": gen.hbm_bw,
        "ici_bw_per_chip_bytes_per_s": gen.ici_bw_per_chip,
        "dcn_bw_per_host_bytes_per_s": spec.dcn_bw_per_host,
        "all_to_all_efficiency": spec.a2a_efficiency,
        "headroom_fraction": headroom_fraction,
        "id_limit": f"measured: {limits.source or 'limits'} ({len(limits.tables)} tables; others the worst case)"
        if limits is not None
        else "worst case: every id of a SparseCore's sample slice in one partition",
    }


def _report_meta(
    tables: Iterable[TableSpec], costing: _Costing, model: str | None, reserved: int, headroom_fraction: float
) -> dict:
    """The report's "meta": everything needed to build it again (`plan show`)."""
    spec, limits = costing.spec, costing.limits
    return {
        "model": model,
        "topology": spec.name,
        "compute_device": costing.compute_device,
        "batch_size": costing.batch_size,
        "optimizer": costing.optimizer,
        "reserved_bytes": reserved,
        "headroom_fraction": headroom_fraction,
        "sc_gather_fraction": spec.sc_gather_fraction,
        "dcn_bw_per_host": spec.dcn_bw_per_host,
        "tables": [asdict(t) | {"extra_features": list(t.extra_features)} for t in tables],  # JSON lists
        "id_limits": limits.to_json() if limits is not None else None,  # so `plan show` sizes buffers alike
    }


def tier_fields(
    t: TableSpec, cache: CacheParams | None, shards: list, curve: HotRows | None, samples: int, host: int
) -> dict:
    """A table's tier in its report row: "hbm" (resident), or "host" with its cache (rows over all its
    shards, load factor, algorithm), its host bytes and the expected hit rate (None without a hot-row
    curve: `tpurec data stats`, then `tpurec plan --limits`)."""
    if cache is None:
        return {"tier": "hbm"}
    # a column-wise table's shards share their rows: its cache is counted once per row range
    ranges = {(offsets[0], sizes[0]) for _, offsets, sizes in shards}
    per_range = [host_tier_shard(t.name, rows, cache) for _, rows in sorted(ranges)]
    cached = sum(p.cached_rows for p in per_range)
    est = table_estimate(curve, cached, samples, per_range[0].algorithm)
    return {
        "tier": "host",
        "cache_rows": cached,
        "load_factor": per_range[0].load_factor,
        "cache_algorithm": per_range[0].algorithm,
        "host_bytes": host,
        "expected_hit_rate": round(est.hit_rate, 4) if est is not None else None,
        "expected_misses_per_batch": round(est.misses_per_batch, 1) if est is not None else None,
    }


TOP_TABLES_PER_DEVICE = 3


def _name_top_tables(devices: list[dict], tables: list[dict]) -> None:
    """Each device's `top_tables`: the tables whose shards there take the most time (the answer to
    "which table makes rank 8 hot?"), with their time and bytes on that device."""
    per_rank: dict[int, dict[str, list]] = {}
    for t in tables:
        for s in t["shards"]:
            acc = per_rank.setdefault(s["rank"], {}).setdefault(t["name"], [0.0, 0])
            acc[0] += s["time_ms"]
            acc[1] += s["bytes"]
    for d in devices:
        ranked = sorted(per_rank.get(d["rank"], {}).items(), key=lambda kv: (-kv[1][0], kv[0]))
        d["top_tables"] = [{"name": n, "time_ms": ms, "bytes": b} for n, (ms, b) in ranked[:TOP_TABLES_PER_DEVICE]]


# ---- planning from table specs, and reports from saved plans (used by `tpurec plan`) ----

from tpurec.planner.planners import PlanDoesNotFit  # noqa: E402,F401  (re-exported for the CLI)


def _topology_for(name: str, hbm_cap: int | None = None, **assumptions: Any) -> Any:  # a TpuTopology
    from tpurec.planner.topology import make_topology

    if name.lower().startswith("cpu-"):
        return make_topology(name, None, "cpu", hbm_cap=hbm_cap)
    return make_topology(name, None, "tpu", hbm_cap=hbm_cap, host_cap=hbm_cap, **assumptions)


# Memory per device when a refused model is planned anyway, for its report: no real device has it.
UNBOUNDED_MEMORY = 2**60


def _bag_configs(tables: list[TableSpec]) -> list[EmbeddingBagConfig]:
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=t.feature_names,
            pooling=PoolingType[t.pooling.upper()],
            data_type=DataType[t.data_type.upper()],
        )
        for t in tables
    ]


def tables_module(tables: list[TableSpec]) -> nn.Module:
    """The tables on the meta device (nothing allocated): one EmbeddingBagCollection (module path ""),
    or, when some tables are weighted or sequence tables (`pooling: none`), a module holding
    `unweighted` and `weighted` EBCs (TorchRec's is_weighted is per collection) and one
    EmbeddingCollection per dim, `sequence_d<dim>` (an EC's tables share one dim)."""
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    def ebc(group: list[TableSpec], weighted: bool) -> EmbeddingBagCollection:
        return EmbeddingBagCollection(_bag_configs(group), is_weighted=weighted, device=torch.device("meta"))

    bags = [t for t in tables if t.pooling != "none"]
    sequences = [t for t in tables if t.pooling == "none"]
    groups = {w: [t for t in bags if t.weighted == w] for w in (False, True)}
    if not sequences and (not groups[True] or not groups[False]):
        return ebc(bags, bool(groups[True]))
    out = nn.Module()
    for name, weighted in (("unweighted", False), ("weighted", True)):
        if groups[weighted]:
            setattr(out, name, ebc(groups[weighted], weighted))
    for dim in sorted({t.embedding_dim for t in sequences}):
        configs = [
            EmbeddingConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                data_type=DataType[t.data_type.upper()],
            )
            for t in sequences
            if t.embedding_dim == dim
        ]
        setattr(out, f"sequence_d{dim}", EmbeddingCollection(tables=configs, device=torch.device("meta")))
    return out


def plan_tables(tables: list, topology: str, **kw: Any) -> dict:
    """Plan `tables` (TableSpecs, or tables_file Entries with their constraints) and return the report.
    On a `cpu-N` topology only the sharding types `tpurec train` runs on CPU are proposed."""
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.planner.kernel_choice import CPU_TRAINING_SHARDING_TYPES
    from tpurec.planner.tables_file import Entry

    on_cpu = topology.lower().startswith("cpu-")
    constraints, specs = {}, []
    for t in tables:
        entry = (
            t if isinstance(t, Entry) else Entry(t, (t.pooling_factor / len(t.feature_names),) * len(t.feature_names))
        )
        specs.append(entry.spec)
        c = ParameterConstraints(pooling_factors=list(entry.feature_pooling))
        if entry.min_partition:
            c.min_partition = entry.min_partition
        types: Iterable[str] | None = entry.sharding_types
        if on_cpu:
            allowed = [s for s in (types or CPU_TRAINING_SHARDING_TYPES) if s in CPU_TRAINING_SHARDING_TYPES]
            if not allowed:
                raise UserError(
                    f"table {entry.spec.name!r}: sharding_types {list(types or ())} include none that CPU training "
                    f"runs ({', '.join(CPU_TRAINING_SHARDING_TYPES)}); plan it for a TPU slice"
                )
            types = allowed
        if types:
            c.sharding_types = list(types)
        constraints[entry.spec.name] = c
    return plan_module(tables_module(specs), specs, topology, constraints=constraints, **kw)


def plan_module(
    module: nn.Module,
    tables: list[TableSpec],
    topology: str,
    *,
    batch_size: int,
    optimizer: str | None,
    constraints: dict[str, ParameterConstraints] | None = None,
    model: str | None = None,
    sc_gather_fraction: float | None = None,
    dcn_bw_per_host: float | None = None,
    headroom_fraction: float | None = None,
    limits: IdLimits | None = None,
    optimizer_source: str | None = None,
    host_tier: str | list[HostTierTable] | None = None,
) -> dict:
    """Plan `module` (its EmbeddingBagCollections, `tables` describing them) and return the report.
    `optimizer_source`: where `optimizer` came from, printed beside it (the report's and meta's).
    `host_tier`: host_tier_flag.parse's (AUTO: the planner moves tables there when they do not fit;
    tables: these, with their caches; None: as the constraints say).

    A model that does not fit is planned again with unbounded memory, so its report still shows
    where the bytes go: `fits` False, `refusal` (the planner's reason) and
    `smallest_fitting_topology` (per TPU generation, see sizing.py)."""
    from tpurec.planner import planners as P
    from tpurec.planner.host_tier_choice import host_tier_tables

    # as planner.plan resolves it (what DMP plans with): the model's own, else SGD
    optimizer = optimizer or P.infer_optimizer(module) or "sgd"
    assumptions: dict[str, Any] = dict(sc_gather_fraction=sc_gather_fraction, dcn_bw_per_host=dcn_bw_per_host)
    topo = _topology_for(topology, **assumptions)
    headroom = P.DEFAULT_HEADROOM_FRACTION if headroom_fraction is None else headroom_fraction
    if isinstance(host_tier, list):
        from tpurec.planner.host_tier_flag import check_tables, with_host_tier

        check_tables(host_tier, [t.name for t in tables])
        constraints = with_host_tier(constraints, host_tier)
    kw: dict[str, Any] = dict(batch_size=batch_size, optimizer=optimizer, constraints=constraints, limits=limits)
    refusal = None
    try:
        auto = host_tier if isinstance(host_tier, str) else None
        plan = P.plan(module, topo, storage_reservation=P.TpuStorageReservation(headroom), host_tier=auto, **kw)
    except PlanDoesNotFit as e:
        refusal = str(e)
        unbounded = _topology_for(topology, hbm_cap=UNBOUNDED_MEMORY, **assumptions)
        plan = P.plan(module, unbounded, storage_reservation=P.TpuStorageReservation(headroom), **kw)
    cap = topo.spec.generation.hbm_bytes
    # what the planner reserved on each device, the TensorCore update's stack copy and work included
    reservation = P.TpuStorageReservation(headroom)
    reservation.optimizer = optimizer
    reservation.host_tier = {n: c for p in module_plans(plan).values() for n, c in host_tier_tables(p).items()}
    report = build_report(
        plan,
        tables,
        topo.spec,
        batch_size=batch_size,
        optimizer=optimizer,
        compute_device=topo.compute_device,
        reserved=reservation.device_bytes(topo, batch_size, module, cap, constraints),
        headroom_fraction=headroom,
        model=model,
        limits=limits,
    )
    from tpurec.planner import remap_memory

    remap_memory.add_to_report(report, remap_memory.remap_buffers(module))  # host RAM, not HBM
    if optimizer_source:
        report["optimizer_source"] = report["meta"]["optimizer_source"] = optimizer_source
    if refusal is not None:
        from tpurec.planner.sizing import smallest_fitting_topology

        smallest = smallest_fitting_topology(
            module, headroom_fraction=headroom, **kw, **{k: v for k, v in assumptions.items() if v is not None}
        )
        report["meta"].update(refusal=refusal, smallest_fitting_topology=smallest)  # so `show` repeats them
        _mark_refused(report, refusal, smallest)
    return report


def _mark_refused(report: dict, refusal: str, smallest: dict) -> None:
    report["fits"] = False  # the planner's verdict, even where the unbounded plan happens to fit
    report["refusal"] = refusal
    report["smallest_fitting_topology"] = smallest


def report_from_plan_and_meta(plan: ShardingPlan, meta: dict) -> dict:
    if not all(meta.get(k) for k in ("tables", "topology", "batch_size", "optimizer")):
        raise UserError(
            "this plan file has no meta (tables, topology, batch size); save it with "
            "tpurec plan --format json, or plan_io.save_plan(plan, path, meta=report['meta'])"
        )
    topo = _topology_for(
        meta["topology"], sc_gather_fraction=meta.get("sc_gather_fraction"), dcn_bw_per_host=meta.get("dcn_bw_per_host")
    )
    tables = [TableSpec(**t) for t in meta["tables"]]
    from tpurec.planner.plan_check import check_plan

    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables}
    source = meta.get("source", "plan")
    # A model with several embedding modules (`--model-module`) splits its tables among them: each
    # module is checked against the tables it names, and together they must cover every table once.
    planned = [name for module_plan in module_plans(plan).values() for name in module_plan]
    missing, twice = sorted(set(shapes) - set(planned)), sorted({n for n in planned if planned.count(n) > 1})
    if missing:
        raise UserError(f"{source}: no sharding for table(s) {missing}; plan this model again")
    if twice:
        raise UserError(f"{source}: table(s) {twice} are sharded by more than one module; plan this model again")
    own = {path: {n: shapes[n] for n in module_plan if n in shapes} for path, module_plan in module_plans(plan).items()}
    check_plan(plan, own, topo.spec.world_size, source=source)
    report = build_report(
        plan,
        tables,
        topo.spec,
        batch_size=meta["batch_size"],
        optimizer=meta["optimizer"],
        compute_device=meta.get("compute_device", "tpu"),
        reserved=meta.get("reserved_bytes", 0),
        headroom_fraction=meta.get("headroom_fraction", 0.0),
        model=meta.get("model"),
        limits=IdLimits.from_json(meta["id_limits"]) if meta.get("id_limits") else None,
    )
    from tpurec.planner import remap_memory

    remap_memory.add_to_report(report, remap_memory.from_meta(meta))
    if meta.get("optimizer_source"):
        report["optimizer_source"] = report["meta"]["optimizer_source"] = meta["optimizer_source"]
    if meta.get("refusal"):
        report["meta"].update(refusal=meta["refusal"], smallest_fitting_topology=meta["smallest_fitting_topology"])
        _mark_refused(report, meta["refusal"], meta["smallest_fitting_topology"])
    return report


def report_from_file(path: str | os.PathLike) -> dict:
    """Recompute the report of a saved plan (plan_io file with meta, or a --format json report)."""
    from tpurec.planner.plan_io import load_meta, load_plan

    return report_from_plan_and_meta(load_plan(path, refused_ok=True), {"source": str(path)} | load_meta(path))
