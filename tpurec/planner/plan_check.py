"""Check a ShardingPlan against the model and world size it is applied to, and re-key its module
paths by table names, so a plan file made by `tpurec plan` (module path "") applies to the model's
EmbeddingBagCollection or EmbeddingCollection wherever it sits. Every problem is one line naming
the table and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, cast

from torch import nn

from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ModuleShardingPlan,
        ParameterSharding,
        ShardingPlan,
    )


class PlanMismatchError(UserError):
    """A plan that does not fit the model or world size it is applied to. The message is `source`
    (which plan: "the plan" inside DMP) then `detail`; `named()` re-says it for a caller that knows
    the plan's file (`tpurec train --plan FILE`), without parsing the message."""

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"{source}{detail}")
        self.source, self.detail = source, detail

    def named(self, source: str) -> PlanMismatchError:
        return PlanMismatchError(source, self.detail)

    def __reduce__(
        self,
    ) -> tuple[type, tuple[str, str]]:  # pickled (a worker's error) with both parts, not the joined message
        return PlanMismatchError, (self.source, self.detail)


def embedding_tables(module: nn.Module) -> dict[str, dict[str, tuple[int, int]]]:
    """{module path: {table name: (rows, dim)}} of every EmbeddingBagCollection and
    EmbeddingCollection in `module`. A feature-processed EBC and a managed-collision EBC/EC are each
    sharded as one module, so their tables are listed at their own path, not their inner collection's."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    out = {}
    inner = set()
    for path, m in module.named_modules():
        if isinstance(m, FeatureProcessedEmbeddingBagCollection):
            inner.add(id(m._embedding_bag_collection))
            m = m._embedding_bag_collection
        elif isinstance(m, BaseManagedCollisionEmbeddingCollection):
            inner.add(id(m._embedding_module))
            m = m._embedding_module
        elif id(m) in inner:
            continue
        if isinstance(m, EmbeddingBagCollection):
            out[path] = {c.name: (c.num_embeddings, c.embedding_dim) for c in m.embedding_bag_configs()}
        elif isinstance(m, EmbeddingCollection):
            out[path] = {c.name: (c.num_embeddings, c.embedding_dim) for c in m.embedding_configs()}
    return out


def module_plans(plan: ShardingPlan) -> dict[str, EmbeddingModuleShardingPlan]:
    """`plan`'s module plans as the embedding module plans they are: tpurec plans embedding
    collections only, and TorchRec types `ShardingPlan.plan` by their base class."""
    return cast("dict[str, EmbeddingModuleShardingPlan]", plan.plan)


def align_to_model(plan: ShardingPlan, module: nn.Module, source: str = "the plan") -> ShardingPlan:
    """The plan with each module plan keyed by the model's path of the EBC holding its tables."""
    return align_to_model_tables(plan, embedding_tables(module), source)


def align_to_model_tables(
    plan: ShardingPlan, paths: Mapping[str, Mapping[str, tuple[int, int]]], source: str = "the plan"
) -> ShardingPlan:
    """`align_to_model` from the model's `embedding_tables` (what a launcher has without the model)."""
    from torchrec.distributed.types import ShardingPlan

    out: dict[str, ModuleShardingPlan] = {}
    for path, module_plan in module_plans(plan).items():
        if path in paths:
            out[path] = module_plan
            continue
        names = set(module_plan)
        owners = [p for p, tables in paths.items() if names <= set(tables)]
        if len(owners) != 1:
            known = {p or "<root>": sorted(t) for p, t in paths.items()}
            raise PlanMismatchError(
                source,
                f": module {path or '<root>'!r} with tables {sorted(names)} matches "
                f"{'no' if not owners else 'more than one'} embedding collection of the model {known}; "
                "plan this model again (leave out the plan)",
            )
        out[owners[0]] = module_plan
    return ShardingPlan(out)


def check_plan(
    plan: ShardingPlan, tables: Mapping[str, Mapping[str, tuple[int, int]]], world_size: int, source: str = "the plan"
) -> None:
    """Raise PlanMismatchError unless every module plan covers exactly its EBC's tables, every shard lies
    inside its table and on a rank < world_size, and the shards cover the table."""
    from torchrec.distributed.types import ShardingType

    types = {t.value for t in ShardingType}
    for path, module_plan in module_plans(plan).items():
        where = f", module {path or '<root>'!r}"
        own = tables.get(path)
        if own is None:
            raise PlanMismatchError(
                source, f"{where}: the model has no EmbeddingBagCollection or EmbeddingCollection there"
            )
        extra, missing = sorted(set(module_plan) - set(own)), sorted(set(own) - set(module_plan))
        if extra:
            raise PlanMismatchError(
                source, f"{where}: table(s) {extra} are not in the model (its tables: {sorted(own)})"
            )
        if missing:
            raise PlanMismatchError(source, f"{where}: no sharding for table(s) {missing}; plan this model again")
        for name, ps in module_plan.items():
            _check_table(source, f"{where}, table {name!r}", ps, own[name], world_size, types)


def place_on_own_device(plan: ShardingPlan, device_type: str) -> None:
    """Place every shard of `plan` on its rank's own device (in place): "rank:R/cpu" on CPU ranks (a
    plan made for TPU ranks, run by CPU ranks), "rank:R/tpu:0" on TPU ranks, whatever the rank's place
    on its host: each TorchTPU process drives one device, its index 0 ("device_ids=[0] which names this
    process's own device", docs/tpu.md), and torch refuses a local shard whose device differs from
    its placement (TorchRec's planner numbers devices by local rank, as for CUDA)."""
    from torch.distributed import _remote_device
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    own = "cpu" if device_type == DeviceKind.CPU else f"{device_type}:0"
    for module_plan in module_plans(plan).values():
        for ps in module_plan.values():
            spec = ps.sharding_spec
            for shard in spec.shards if isinstance(spec, EnumerableShardingSpec) else ():
                if shard.placement is not None and str(shard.placement.device()) != own:
                    shard.placement = _remote_device(f"rank:{shard.placement.rank()}/{own}")


def check_plan_for_tpu(plan: ShardingPlan, source: str = "the plan") -> None:
    """Raise PlanMismatchError for a sharding a TPU cannot run (kernel_choice.NEEDS_SUBGROUPS), naming the table."""
    from tpurec.planner.kernel_choice import NEEDS_SUBGROUPS, SUBGROUP_REFUSAL

    _refuse_sharding_types(plan, source, set(NEEDS_SUBGROUPS), f"{SUBGROUP_REFUSAL}; plan again for the TPU")


# Kernels a plan made for TorchRec's own sharder names, which tpurec's kernel stands in for: FBGEMM's
# fused TBE family, and "dense", what TorchRec's sharding-plan helpers (`construct_module_sharding_plan`
# with `table_wise()`, `row_wise()` ... and no sharder) pick by default. Any other kernel (quantized,
# key-value, SSD) is refused.
FBGEMM_FUSED_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "dense")


def adopt_compute_kernels(plan: ShardingPlan, paths: Iterable[str], source: str = "the plan") -> list[str]:
    """Tables of the modules at `paths` (the ones tpurec's sharders shard: `embedding_tables`) that a
    plan (a saved TorchRec one) puts on FBGEMM's fused kernels are put on tpurec's
    SparseCore kernel, in place: TorchRec would otherwise build FBGEMM's kernel inside tpurec's
    sharded module, silently. Returns "table (kernel)" for each table moved, for one notice; any
    other kernel is refused (PlanMismatchError naming the table)."""
    from torchrec.distributed.types import CacheParams

    from tpurec.planner.host_tier_choice import HOST_TIER_KERNEL
    from tpurec.planner.kernel_choice import COMPUTE_KERNEL

    moved, ours = [], set(paths)
    for path, module_plan in module_plans(plan).items():
        for name, ps in module_plan.items() if path in ours else ():
            if ps.compute_kernel == COMPUTE_KERNEL:
                continue
            if ps.compute_kernel not in FBGEMM_FUSED_KERNELS:
                raise PlanMismatchError(
                    source,
                    f", module {path or '<root>'!r}, table {name!r}: compute_kernel {ps.compute_kernel!r} is not "
                    f"tpurec's SparseCore kernel nor one it stands in for ({', '.join(FBGEMM_FUSED_KERNELS)}); plan "
                    "again with tpurec",
                )
            # FBGEMM's UVM cache is tpurec's host tier (host_tier_choice.py), its CacheParams kept (TorchRec's
            # defaults where the plan has none); TorchRec ignores cache_params on the other kernels, so does tpurec
            host_tier = ps.compute_kernel == HOST_TIER_KERNEL
            moved.append(f"{name} ({ps.compute_kernel}{': host tier' if host_tier else ''})")
            ps.cache_params = (ps.cache_params or CacheParams()) if host_tier else None
            ps.compute_kernel = COMPUTE_KERNEL
    return moved


def check_sharding_types(plan: ShardingPlan, source: str = "the plan") -> None:
    """Raise PlanMismatchError for a sharding type TorchRec offers that tpurec's kernel does not run
    (data-parallel, grid sharding), naming the table; TorchRec would fail deep inside instead."""
    from torchrec.distributed.types import ShardingType

    from tpurec.planner.kernel_choice import SHARDING_TYPES

    unsupported = {t.value for t in ShardingType} - set(SHARDING_TYPES)
    why = f"is not run by tpurec's SparseCore kernel (it runs {', '.join(SHARDING_TYPES)}); plan again without it"
    _refuse_sharding_types(plan, source, unsupported, why)


def check_managed_collision_row_wise(plan: ShardingPlan, module: nn.Module, source: str = "the plan") -> None:
    """Raise PlanMismatchError for a managed-collision table (`--zch`, an MC-EBC/EC) the plan shards
    other than row_wise: TorchRec's remap asserts row-wise sharding deep inside DMP (a plan saved
    without --zch is table-wise)."""
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    paths = {p for p, m in module.named_modules() if isinstance(m, BaseManagedCollisionEmbeddingCollection)}
    why = (
        "is not for a managed-collision table (--zch): TorchRec's remap shards those row_wise only; "
        "plan with --zch (tpurec train --zch --save-plan FILE) or leave out --plan"
    )
    refused = {t.value for t in ShardingType} - {ShardingType.ROW_WISE.value}
    _refuse_sharding_types(plan, source, refused, why, paths)


def _refuse_sharding_types(
    plan: ShardingPlan, source: str, refused: set[str], why: str, paths: set[str] | None = None
) -> None:
    for path, module_plan in module_plans(plan).items():
        if paths is not None and path not in paths:
            continue
        for name, ps in module_plan.items():
            if ps.sharding_type in refused:
                raise PlanMismatchError(
                    source, f", module {path or '<root>'!r}, table {name!r}: sharding_type {ps.sharding_type!r} {why}"
                )


def _check_table(
    source: str, where: str, ps: ParameterSharding, shape: tuple[int, int], world_size: int, types: set
) -> None:
    if ps.sharding_type not in types:
        raise PlanMismatchError(source, f"{where}: sharding_type {ps.sharding_type!r} is not one of {sorted(types)}")
    for r in ps.ranks or []:
        _check_rank(source, where, r, world_size)
    spec = ps.sharding_spec
    if spec is None:
        return
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    assert isinstance(spec, EnumerableShardingSpec), type(spec)  # what plan_io builds, as TorchRec does
    rows, dim = shape
    area = 0
    for s in spec.shards:
        (r0, c0), (nr, nc) = s.shard_offsets, s.shard_sizes
        rank = s.placement.rank() if s.placement is not None else None
        assert rank is not None, f"{where}: a shard without a rank"  # plan files and TorchRec place every shard
        _check_rank(source, where, rank, world_size)
        # An empty shard is legal: TorchRec's row-wise split of a table with fewer rows than ranks
        # gives the last ranks 0 rows (dlrm-tiny's 3-row t_C9 on 4 devices).
        if min(r0, c0, nr, nc) < 0 or r0 + nr > rows or c0 + nc > dim:
            raise PlanMismatchError(
                source,
                f"{where}: shard at offsets {[r0, c0]} sizes {[nr, nc]} does not fit the table ({rows} x {dim}): "
                "a plan made for another model or other table sizes?",
            )
        area += nr * nc
    if area != rows * dim:
        raise PlanMismatchError(
            source,
            f"{where}: shards cover {area:,} of the table's {rows * dim:,} elements ({rows} x {dim}): a plan made "
            "for another model?",
        )


def _check_rank(source: str, where: str, rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise PlanMismatchError(
            source,
            f"{where}: placed on rank {rank}, but the world size is {world_size} (a plan made for another "
            "world size: plan again for this one)",
        )


def planned_world_size(doc: Mapping) -> int | None:
    """The number of devices a plan file (`read_doc`'s object) was planned for: a report's
    `world_size`, else its meta's topology (`cpu-N`, or a slice name); None when it does not say."""
    from tpurec.planner.topology import cpu_ranks, parse_slice

    world = doc.get("world_size")
    if isinstance(world, int) and not isinstance(world, bool) and world >= 1:
        return world
    meta = doc.get("meta") or (doc.get("plan") or {}).get("meta") or {}
    topology = meta.get("topology") if isinstance(meta, Mapping) else None
    if not isinstance(topology, str):
        return None
    try:
        return cpu_ranks(topology) if topology.lower().startswith("cpu-") else parse_slice(topology).world_size
    except UserError:  # a topology name tpurec does not know: the shards' ranks are still checked
        return None


def check_plan_world(doc: Mapping, world_size: int, source: str) -> None:
    """UserError when the plan was made for another number of devices than the run has. Its ranks
    all exist in a larger world (a cpu-1 plan on 4 ranks), so the shard check alone let it run with
    every table on rank 0 and the other ranks idle, without a word."""
    planned = planned_world_size(doc)
    if planned is not None and planned != world_size:
        meta = doc.get("meta") or (doc.get("plan") or {}).get("meta") or {}
        topology = meta.get("topology") if isinstance(meta, Mapping) else None
        named = f"{topology}, {planned} device(s)" if isinstance(topology, str) else f"{planned} device(s)"
        raise UserError(
            f"{source} was planned for {named}, but this run has {world_size}: plan for the devices you run "
            f"(tpurec plan --topology ...; cpu-{world_size} for {world_size} CPU ranks)"
        )
