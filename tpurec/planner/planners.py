"""TPU-aware sharding planner: torchrec's EmbeddingShardingPlanner with tpurec's cost model.

Nothing is forked: we hand torchrec's planner our estimators (estimators.py), a storage
reservation for what is not an embedding shard, an enumerator that drops options the SparseCore
kernel cannot run, and a planning-time sharder that offers only our kernel and sharding types.
The result is a standard `ShardingPlan`.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Dict, List, cast

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from torchrec.distributed.planner.types import (
    Enumerator,
    ParameterConstraints,
    Perf,
    PlannerError,
    Proposer,
    Shard,
    ShardEstimator,
    ShardingOption,
    Storage,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from tpurec.embedding.constraints import DIM_ALIGN
from tpurec.embedding.optimizers.registry import spec_class, spec_name_for, spec_names
from tpurec.errors import UserError
from tpurec.planner.estimators import (
    TpuPerfEstimator,
    TpuStorageEstimator,
    shard_cost,
    spec_of,
    table_elem_bytes,
)
from tpurec.planner.host_memory import HOST_HEADROOM_FRACTION
from tpurec.planner.kernel_choice import COMPUTE_KERNEL, EC_SHARDING_TYPES, SHARDING_TYPES, sharding_types_for
from tpurec.planner.partitioner import TpuPartitioner
from tpurec.planner.plan_bounds import tables_problem
from tpurec.planner.plan_check import place_on_own_device
from tpurec.planner.plan_errors import PlanDoesNotFit
from tpurec.planner.planned_shard import planned_shards
from tpurec.planner.proposal_budget import (
    DEFAULT_SHARD_BUDGET,
    NO_FIT_FACTOR,
    SearchBoundReached,
    bound_reached,
    budgeted,
)
from tpurec.planner.topology import format_bytes
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import QuantizedCommCodecs
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig

    from tpurec.planner.id_limits import IdLimits

# Share of each device kept free for the XLA runtime, compiled programs and fragmentation; an
# assumption (docs/planner.md), overridable per call.
DEFAULT_HEADROOM_FRACTION = 0.05
# Dense parameters cost weights + gradients + two Adam moments (the usual dense optimizer).
DENSE_BYTES_PER_PARAM_BYTE = 4


class TpuPlanningSharder(EmbeddingBagCollectionSharder):
    """Offers torchrec's planner only what the SparseCore kernel runs: COMPUTE_KERNEL and
    SHARDING_TYPES (no data-parallel). The real sharder (sharder.py) may be passed instead."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sharding_types_for(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [COMPUTE_KERNEL]


class TpuPlanningECSharder(EmbeddingCollectionSharder):
    """TpuPlanningSharder's counterpart for EmbeddingCollections (sequence tables): TW, CW, RW."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(EC_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [COMPUTE_KERNEL]


class TpuPlanningFPSharder(FeatureProcessedEmbeddingBagCollectionSharder):
    """TorchRec's FP-EBC sharder offering what its inner EBC sharder offers (default: TpuPlanningSharder).
    The run-time sharder (sharding/fp_sharder.py's SparseCoreFPEBCSharder) derives from it."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(ebc_sharder=ebc_sharder or TpuPlanningSharder(), qcomm_codecs_registry=qcomm_codecs_registry)

    @property
    def ebc_sharder(self) -> EmbeddingBagCollectionSharder:
        return self._ebc_sharder

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return self._ebc_sharder.sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._ebc_sharder.compute_kernels(sharding_type, compute_device_type)


class TpuPlanningMCEBCSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collision EBC sharder offering its inner sharder's kernel (TorchRec's lists FBGEMM's);
    its sharding types stay TorchRec's (row-wise: the remap's). The run-time sharder
    (sharding/mc_sharder.py's SparseCoreMCEBCSharder) derives from it."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            ebc_sharder=ebc_sharder or TpuPlanningSharder(),
            mc_sharder=mc_sharder,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)


class TpuPlanningMCECSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TpuPlanningMCEBCSharder's counterpart for managed-collision EmbeddingCollections."""

    def __init__(
        self,
        ec_sharder: EmbeddingCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            ec_sharder=ec_sharder or TpuPlanningECSharder(),
            mc_sharder=mc_sharder,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)


def planning_sharders() -> List[ModuleSharder[nn.Module]]:
    # A feature-processed or managed-collision EBC is planned as the module DMP shards, over its inner
    # collection's tables. ModuleSharder is invariant in its module type: TorchRec's own default sharders
    # are cast the same way.
    sharders = [
        TpuPlanningSharder(),
        TpuPlanningECSharder(),
        TpuPlanningFPSharder(),
        TpuPlanningMCEBCSharder(),
        TpuPlanningMCECSharder(),
    ]
    return [cast(ModuleSharder[nn.Module], s) for s in sharders]


def _embedding_modules(module: nn.Module) -> list[EmbeddingBagCollection | EmbeddingCollection]:
    return [m for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


class TpuEnumerator(EmbeddingEnumerator):
    """Drops data-parallel options and kernels other than ours. Any dim and column-shard width is
    kept: the kernel stores rows padded to 8 floats, and the estimators count the padded bytes, so a
    narrow column shard costs what it really costs."""

    def enumerate(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> List[ShardingOption]:
        options = super().enumerate(module, sharders)
        kept = [o for o in options if o.sharding_type in SHARDING_TYPES and o.compute_kernel == COMPUTE_KERNEL]
        lost = sorted({o.name for o in options} - {o.name for o in kept})
        if lost:
            raise UserError(
                f"no sharding option the SparseCore kernel can run for table(s) {lost}: it needs compute kernel "
                f"{COMPUTE_KERNEL!r} and one of {SHARDING_TYPES}; check the sharders and ParameterConstraints"
            )
        planned_shards(kept)  # cheaper for the planner to copy and hash
        return kept

    def _get_num_buckets(self, parameter: str, module: nn.Module) -> int | None:
        # A managed-collision table whose remap has one bucket (MCHManagedCollisionModule's) shards its
        # slots row-wise like any table: TorchRec's planner refuses it at world > 1 behind an internal
        # switch meant for multi-bucket remaps (enumerators.py, "uneven buckets per rank"), while the
        # same row-wise plan given to TorchRec's DMP trains (tests/sharding/test_mc_dmp.py).
        from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

        if isinstance(module, BaseManagedCollisionEmbeddingCollection):
            buckets = module._managed_collision_collection.table_to_number_buckets().get(parameter)
            if buckets == 1:
                return None
        return super()._get_num_buckets(parameter, module)


def _table_configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    return [
        c
        for m in _embedding_modules(module)
        for c in (m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection) else m.embedding_configs())
    ]


class TpuStorageReservation(StorageReservation):
    """Per device: dense parameters (x4: weights, grads, Adam moments), the pooled embeddings every
    rank receives for its local batch and their gradients, plus a headroom fraction; on a chip the
    TensorCore kernel drives (v5e, v4), the fused update's copy of one stack and its work arrays
    (`stack_transient`)."""

    def __init__(self, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION, dense_bytes: int = 0) -> None:
        self._headroom = headroom_fraction
        self._extra = dense_bytes
        self._last: Topology | None = None
        self.reserved_bytes = 0
        self._fixed: tuple[weakref.ref, int, int] | None = None  # (module, batch_size, bytes) last computed
        # the tables the plan being made keeps on the host tier (make_planner sets it per attempt): the
        # update's stack copy holds their caches' rows, not the whole tables
        self.host_tier: Mapping[str, CacheParams] = {}
        self.optimizer: str | None = None  # the plan's table optimizer (make_planner sets it): the copy's state

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: List[ModuleSharder[nn.Module]],
        constraints: Dict[str, ParameterConstraints] | None = None,
    ) -> Topology:
        reserved = copy.deepcopy(topology)
        on_cpu = topology.compute_device == DeviceKind.CPU
        one_stack = self.update_transient(topology, batch_size, module, sharders, constraints)
        for device in reserved.devices:
            cap = device.storage.ddr if on_cpu else device.storage.hbm
            amount = min(cap, self.amount(module, batch_size, cap) + one_stack)
            if on_cpu:
                device.storage.ddr -= amount
            else:
                device.storage.hbm -= amount
                # host memory, the host tier's (host_memory.py): what else the host runs keeps a share
                device.storage.ddr -= int(device.storage.ddr * HOST_HEADROOM_FRACTION)
            self.reserved_bytes = amount
        self._last = reserved
        return reserved

    def update_transient(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: List[ModuleSharder[nn.Module]] | None = None,
        constraints: Dict[str, ParameterConstraints] | None = None,
    ) -> int:
        """`stack_transient` for this plan's topology (0 on CPU ranks) at `batch_size` per device."""
        if topology.compute_device == DeviceKind.CPU:
            return 0
        return stack_transient(
            spec_of(topology).generation.name,
            module,
            sharders,
            self.host_tier,
            batch_size=batch_size * topology.world_size,
            constraints=constraints,
            optimizer=self.optimizer,
        )

    def device_bytes(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        capacity: int,
        constraints: Dict[str, ParameterConstraints] | None = None,
    ) -> int:
        """What `reserve` takes from a device of `capacity` bytes: the plan report's reserved bytes."""
        one_stack = self.update_transient(topology, batch_size, module, None, constraints)
        return min(capacity, self.amount(module, batch_size, capacity) + one_stack)

    def amount(self, module: nn.Module, batch_size: int, capacity: int) -> int:
        # Asked once per device: the part that walks every table is kept for the same module and
        # batch (it made reserving O(tables x devices): 17 s of a 1,000-table plan on 64 devices).
        if self._fixed is None or self._fixed[0]() is not module or self._fixed[1] != batch_size:
            sharded = {id(p) for m in _embedding_modules(module) for p in m.parameters()}
            dense = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in sharded)
            pooled = batch_size * sum(c.embedding_dim for c in _table_configs(module)) * 4 * 2
            self._fixed = (weakref.ref(module), batch_size, dense * DENSE_BYTES_PER_PARAM_BYTE + pooled + self._extra)
        return int(self._fixed[2] + self._headroom * capacity)

    @property
    def last_reserved_topology(self) -> Topology | None:
        return copy.deepcopy(self._last)


def _for_host_tier(
    reservation: StorageReservation, host_tier: Mapping[str, CacheParams] | None, optimizer: str | None = None
) -> StorageReservation:
    if isinstance(reservation, TpuStorageReservation):
        reservation.host_tier = dict(host_tier or {})
        reservation.optimizer = optimizer
    return reservation


# The TensorCore update program's work arrays beside its new stack (update_jax.row_gradients over
# csr_jax.decode's entries): per slot its gradient row times its gain ([slots, width] float32) and
# its decoded entry (row, sample, gain, valid, segment: 18 bytes); per distinct row its summed
# gradient ([distinct, width] float32). XLA's memory_analysis() of tpu_bridge.tc_adagrad, compiled
# on CPU (TPU's buffers approximate it) at the eight stacks of `tpurec bench tpu-train`'s MLPerf
# DLRM-DCNv2 (batch 16,384, rows capped at 2M), matched this within 0.3% for each stack: the largest,
# 1,388,872 slots and 258,784 distinct rows of width 128, took 868,593,240 temp bytes (here 868,599,568).
UPDATE_SLOT_EXTRA_BYTES = 18


def update_work_bytes(slots: int, distinct: int, width: int) -> int:
    """Temporary bytes of the TensorCore update program over `slots` ids and `distinct` rows."""
    return slots * (4 * width + UPDATE_SLOT_EXTRA_BYTES) + distinct * 4 * width


def stack_transient(
    generation: str,
    module: nn.Module,
    sharders: List[ModuleSharder] | None = None,
    host_tier: Mapping[str, CacheParams] | None = None,
    *,
    batch_size: int = 0,
    constraints: Dict[str, ParameterConstraints] | None = None,
    optimizer: str | None = None,
) -> int:
    """Bytes the TensorCore kernel's fused update holds besides the live tables, on a chip it drives
    (v5e, v4; else 0: per shard, estimators.py), for the stack that needs the most: its new rows and
    state (the program returns them and they are copied back: tpu_bridge.py) and, given the global
    `batch_size` (ids per sample from the constraints' pooling factors, else 1), the program's work
    arrays (`update_work_bytes`). Stacks are updated one by one, so one at a time; they are cut as
    the kernel cuts them (layout.build_stacks at TENSORCORE_MAX_STACK_BYTES), a host-tier table's
    rows its cache's. Per stack its slots are its ids a batch plus the kernel's first-batch headroom
    (FIRST_BATCH_HEADROOM_TENSORCORE) and its distinct rows at most those slots and its rows (the
    unique-id limit, which only measured data would tighten): every table is assumed to serve the
    whole global batch on the device, as table-wise sharding does (an upper bound otherwise)."""
    from tpurec.embedding.host_tier.params import host_tier_params
    from tpurec.embedding.layout import build_stacks
    from tpurec.embedding.settings import FIRST_BATCH_HEADROOM_TENSORCORE, TENSORCORE_MAX_STACK_BYTES
    from tpurec.runtime.device import tensorcore_only

    configs = _table_configs(module)
    if not tensorcore_only(generation) or not configs:
        return 0
    spec = spec_class(optimizer or infer_optimizer(module, sharders) or "sgd")
    tier = host_tier or {}
    pooling = {
        c.name: sum((constraints or {}).get(c.name, ParameterConstraints()).pooling_factors or [1.0]) for c in configs
    }

    def stored(c: BaseEmbeddingConfig) -> int:
        return (
            host_tier_params(c.name, c.num_embeddings, tier[c.name]).cached_rows if c.name in tier else c.num_embeddings
        )

    stacks = build_stacks(
        [(c.name, stored(c), c.embedding_dim) for c in configs],
        1,  # the TensorCore kernel's stacks have one partition
        expected_ids=pooling,
        max_bytes=TENSORCORE_MAX_STACK_BYTES,
    )
    most = 0
    for stack in stacks:
        width, rows = stack.storage_dim, stack.total_rows
        copy = rows * (4 * width + spec.state_bytes_per_row(width))
        ids = batch_size * sum(pooling[t.name] for t in stack.tables)
        slots = math.ceil(ids * (1 + FIRST_BATCH_HEADROOM_TENSORCORE))
        most = max(most, copy + update_work_bytes(slots, min(slots, rows), width))
    return most


def infer_optimizer(module: nn.Module, sharders: List[ModuleSharder] | None = None) -> str | None:
    """The fused optimizer the tables will train with, from apply_optimizer_in_backward settings
    or sharder fused_params; the one with the most state if tables differ; None if unknown."""
    found = set()
    for m in _embedding_modules(module):
        for p in m.parameters():
            for cls in getattr(p, "_optimizer_classes", []) or []:
                # torch / TorchRec class names (apply_optimizer_in_backward)
                found.add(spec_name_for(cls.__name__) or cls.__name__)
    for sharder in sharders or []:
        opt = (getattr(sharder, "fused_params", None) or {}).get("optimizer")
        if opt is not None:
            key = str(getattr(opt, "value", opt))  # FBGEMM EmbOptimType values (sharder fused_params)
            found.add(spec_name_for(key) or key)
    unknown = found - set(spec_names())
    if unknown:
        raise UserError(
            f"optimizer(s) {sorted(unknown)} not supported by the fused SparseCore update; "
            f"one of {sorted(spec_names())}"
        )
    if not found:
        return None
    return max(found, key=lambda o: spec_class(o).state_bytes_per_row(DIM_ALIGN))


def _perf(shard: Shard) -> Perf:
    assert shard.perf is not None, "a shard reached the proposer unestimated"  # the enumerator estimates all
    return shard.perf


def _storage(shard: Shard) -> Storage:
    assert shard.storage is not None, "a shard reached the proposer unestimated"
    return shard.storage


def _placeable_copy(plan: List[ShardingOption]) -> List[ShardingOption]:
    """A copy of `plan` the partitioner may place: each option and shard copied, their contents
    shared (the partitioner only assigns shard ranks). copy.deepcopy of MLPerf DCNv2's options on
    v5p-128 (128 shards a row-wise table) took 0.26 s of `tpurec plan`'s 5."""
    out = []
    for option in plan:
        placed = copy.copy(option)
        placed.shards = [copy.copy(s) for s in option.shards]
        out.append(placed)
    return out


class CriticalDeviceProposer(Proposer):
    """Spreads, one table at a time, whatever sits on the device that sets the step time.

    torchrec's greedy proposers rank each table's options by that table's own shard times, which
    on big slices spreads mid-size tables row-wise over every device, where each row-wise shard
    still pays the full pooled-output collective. Here: start from each table's cheapest option in
    total work, partition, take the slowest device, and move its heaviest table that can still be
    spread to its next shallower option (TW -> TWRW -> RW ...). Every step is rated by the planner,
    which keeps the best plan of all proposers; this one runs after torchrec's defaults.
    """

    def __init__(self, max_proposals: int = 150) -> None:
        self._max = max_proposals

    @staticmethod
    def _depth(option: ShardingOption) -> float:
        return max(_perf(s).total for s in option.shards)

    @staticmethod
    def _largest_shard(option: ShardingOption) -> float:
        return max(_storage(s).hbm + _storage(s).ddr for s in option.shards)

    def load(self, search_space: List[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._options: Dict[str, List[ShardingOption]] = {}
        for o in search_space:
            self._options.setdefault(o.fqn, []).append(o)
        for opts in self._options.values():
            opts.sort(key=lambda o: (-self._depth(o), o.total_perf))  # deepest (least spread) first
        self._next: Dict[str, int] | None = {
            f: min(range(len(v)), key=lambda i: v[i].total_perf) for f, v in self._options.items()
        }
        # If the cheapest start does not fit, start again fully spread.
        self._fallback: Dict[str, int] | None = {f: len(v) - 1 for f, v in self._options.items()}
        self._current: Dict[str, int] | None = None
        self._count = 0

    def propose(self) -> List[ShardingOption] | None:
        if self._next is None or self._count >= self._max:
            return None
        self._current, self._next = self._next, None
        self._count += 1
        return [self._options[f][i] for f, i in self._current.items()]

    def feedback(
        self,
        partitionable: bool,
        plan: List[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if not partitionable or not plan:
            # Does not fit: spread the table with the largest shard one step further (on a TPU the
            # update's transient doubles a table-wise 40M x 128 table to 38 GiB, more than a v6e
            # holds); only when nothing can be spread further, start over fully spread.
            self._next = self._spread_largest() if self._current is not None else None
            if self._next is None:
                self._next, self._fallback = self._fallback, None
            return
        assert self._current is not None  # feedback answers a proposal
        if storage_constraint is not None and any(s.rank is None for o in plan for s in o.shards):
            # A proposal the planner had partitioned before (for torchrec's proposers or for this one)
            # comes back from its cache with the shard ranks it cleared since (planners.py,
            # reset_shard_rank): partition a copy again, as the planner did, to find the slowest device.
            plan = TpuPartitioner().partition(_placeable_copy(plan), storage_constraint)
        load: Dict[int, float] = {}
        on_rank: Dict[int, Dict[str, float]] = {}
        for o in plan:
            for s in o.shards:
                rank = s.rank
                assert rank is not None  # a partitioned plan places every shard
                load[rank] = load.get(rank, 0.0) + _perf(s).total
                per_table = on_rank.setdefault(rank, {})
                per_table[o.fqn] = per_table.get(o.fqn, 0.0) + _perf(s).total
        critical = max(load, key=load.__getitem__)
        for fqn, _ in sorted(on_rank[critical].items(), key=lambda kv: -kv[1]):
            opts, i = self._options[fqn], self._current[fqn]
            shallower = [j for j in range(i + 1, len(opts)) if self._depth(opts[j]) < self._depth(opts[i])]
            if shallower:
                self._next = {**self._current, fqn: shallower[0]}
                return
        self._next = None

    def _spread_largest(self) -> Dict[str, int] | None:
        assert self._current is not None  # called after a proposal
        by_size = sorted(self._current.items(), key=lambda kv: -self._largest_shard(self._options[kv[0]][kv[1]]))
        for fqn, i in by_size:
            opts = self._options[fqn]
            smaller = [
                j for j in range(i + 1, len(opts)) if self._largest_shard(opts[j]) < self._largest_shard(opts[i])
            ]
            if smaller:
                # the least spread of the options with smaller shards, the cheapest among equals
                best = min(smaller, key=lambda j: (-self._depth(opts[j]), opts[j].total_perf))
                return {**self._current, fqn: best}
        return None


def make_planner(
    topology: Topology,
    *,
    batch_size: int,
    constraints: Dict[str, ParameterConstraints] | None = None,
    optimizer: str = "sgd",
    storage_reservation: StorageReservation | None = None,
    limits: IdLimits | None = None,
    host_tier: Mapping[str, CacheParams] | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner with tpurec's parts; `host_tier`: the tables on the host tier, costed so."""
    estimators: List[ShardEstimator] = [
        TpuPerfEstimator(topology, constraints, optimizer, limits, host_tier),
        TpuStorageEstimator(topology, constraints, optimizer, limits, host_tier),
    ]
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=TpuEnumerator(
            topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimators
        ),
        storage_reservation=_for_host_tier(storage_reservation or TpuStorageReservation(), host_tier, optimizer),
        partitioner=TpuPartitioner(),  # TorchRec's greedy placement, its uniform step in one pass
        # torchrec's default proposers, then ours (see CriticalDeviceProposer), each within a work
        # budget once a plan fits (proposal_budget.py: planning time about linear in tables x devices)
        proposer=budgeted(
            [
                GridSearchProposer(),
                GreedyProposer(),
                GreedyProposer(use_depth=False),
                UniformProposer(),
                CriticalDeviceProposer(),
            ]
        ),
        constraints=constraints,
        debug=False,
    )


def _fmt(nbytes: float) -> str:
    return format_bytes(nbytes)


def _refusal(
    module: nn.Module,
    topology: Topology,
    batch_size: int,
    constraints: Dict[str, ParameterConstraints] | None,
    optimizer: str,
    reservation: TpuStorageReservation,
    limits: IdLimits | None = None,
) -> str:
    """Name the largest table, what it needs on one device, and what the best device has free."""
    spec = spec_of(topology)
    on_cpu = topology.compute_device == DeviceKind.CPU
    caps = [d.storage.ddr if on_cpu else d.storage.hbm for d in topology.devices]
    reserved = [reservation.amount(module, batch_size, c) for c in caps]
    free = [c - r for c, r in zip(caps, reserved)]
    best = max(range(len(free)), key=free.__getitem__)
    costs = {}
    for cfg in _table_configs(module):
        pf = sum((constraints or {}).get(cfg.name, ParameterConstraints()).pooling_factors or [1.0])
        costs[cfg.name] = (
            cfg,
            shard_cost(
                sharding_type="table_wise",
                rows=cfg.num_embeddings,
                cols=cfg.embedding_dim,
                pooling_factor=pf,
                batch_per_device=batch_size,
                world_size=topology.world_size,
                num_shards=1,
                spec=spec,
                optimizer=optimizer,
                elem_bytes=table_elem_bytes(cfg.data_type, topology.compute_device),
                num_features=len(cfg.feature_names),
                max_ids_per_partition=limits.max_ids(
                    cfg.name, batch_size * topology.world_size, pf, max(1, spec.generation.sparsecores)
                )
                if limits is not None
                else None,
            ),
        )
    name, (cfg, c) = max(costs.items(), key=lambda kv: kv[1][1].bytes)
    # Weights, state and the update's transient copy split with the table, whatever the sharding:
    # together they bound the whole slice. Free memory is never shown below zero.
    at_least = sum(x.weights + x.optimizer + x.transient for _, x in costs.values())
    slice_free = sum(max(0, f) for f in free)
    head = (
        f"plan does not fit on {spec.name} ({topology.world_size} device{'s' * (topology.world_size > 1)} of "
        f"{_fmt(caps[best])}, optimizer {optimizer}): "
    )
    largest = (
        f"the largest table {name} ({cfg.num_embeddings:,} x {cfg.embedding_dim}) needs "
        f"{_fmt(c.bytes)} (weights {_fmt(c.weights)}, optimizer state {_fmt(c.optimizer)}, SparseCore buffers "
        f"{_fmt(c.buffers)}, activations {_fmt(c.activations)}"
        + (f", the update's transient new table and state {_fmt(c.transient)}" if c.transient else "")
        + ") on one device"
    )
    device = (
        f"the best device (rank {best}) has {_fmt(max(0, free[best]))} free of {_fmt(caps[best])} after "
        f"reserving {_fmt(reserved[best])}"
    )
    total = (
        f"all {len(costs)} tables need at least {_fmt(at_least)} of weights and optimizer state"
        + (" with the update's transient copy" if any(x.transient for _, x in costs.values()) else "")
        + f" against {_fmt(slice_free)} free on the whole slice"
    )
    if free[best] <= 0:
        verdict = (
            f"the reservation alone ({_fmt(reserved[best])} per device: dense layers, activations and headroom "
            f"for batch {batch_size:,} per device) is more than a device's {_fmt(caps[best])}, leaving nothing "
            "for the tables; plan a smaller batch per device"
        )
        return head + "; ".join([verdict, total, largest])
    if at_least > slice_free:
        return head + "the tables together are the limit: " + "; ".join([total, device, largest])
    if c.bytes > free[best]:
        return head + "the largest table is the limit: " + "; ".join([largest, device, total])
    return head + "no sharding the planner proposed fits each device: " + "; ".join([device, largest, total])


def pooling_constraints(
    pooling: Dict[str, float], base: Dict[str, ParameterConstraints] | None = None
) -> Dict[str, ParameterConstraints]:
    """ParameterConstraints carrying each table's mean pooling factor (ids per sample)."""
    out = dict(base or {})
    for name, pf in pooling.items():
        c = copy.copy(out.get(name, ParameterConstraints()))
        c.pooling_factors = [float(pf)]
        out[name] = c
    return out


def plan(
    module: nn.Module,
    topology: Topology,
    *,
    batch_size: int,
    constraints: Dict[str, ParameterConstraints] | None = None,
    sharders: List[ModuleSharder[nn.Module]] | None = None,
    optimizer: str | None = None,
    pg: dist.ProcessGroup | None = None,
    storage_reservation: TpuStorageReservation | None = None,
    limits: IdLimits | None = None,
    host_tier: str | None = None,
) -> ShardingPlan:
    """Plan `module` (a model holding EmbeddingBagCollections, meta tensors fine) on `topology`.

    `batch_size` is per device. `optimizer` defaults to what apply_optimizer_in_backward or the
    sharders' fused_params say, else SGD. With `pg`, rank 0 plans and broadcasts. `limits`
    (tpurec.planner.id_limits.IdLimits): SparseCore buffers sized from measured id limits, and the
    tables' hot-row curves. Tables whose constraints name `fused_uvm_caching` go on the host tier
    with their CacheParams (host_tier_choice.py); `host_tier="auto"`: a model that does not fit a
    TPU slice's device memory is planned again with tables moved there (host_tier_plan.py).
    Raises PlanDoesNotFit when the tables cannot fit.
    """
    from tpurec.planner import host_tier_choice as choice
    from tpurec.planner import host_tier_plan

    too_many = tables_problem(len(_table_configs(module)), topology.world_size)
    if too_many:  # planning would take hours (plan_bounds.py): refused before it starts
        raise UserError(f"{too_many}; plan fewer tables, or pass a saved plan")
    uneven = uneven_buckets(module, topology.world_size)
    if uneven:  # TorchRec's enumerator raises a bare ValueError for it in the middle of planning
        raise UserError(uneven)
    optimizer = optimizer or infer_optimizer(module, sharders) or "sgd"
    sharders = sharders or planning_sharders()
    reservation = storage_reservation or TpuStorageReservation()
    requests = choice.host_tier_requests(constraints)
    planning = choice.planning_constraints(constraints)
    one_memory = topology.compute_device == DeviceKind.CPU

    def fits(req: Dict[str, CacheParams]) -> str | None:
        return _fits_by_bytes(module, topology, batch_size, optimizer, reservation, req)

    def attempt(req: Dict[str, CacheParams]) -> ShardingPlan:
        why = fits(req)
        if why is not None:  # fast refusal: weights + optimizer state alone exceed the slice's free memory
            raise PlanDoesNotFit(
                why
                if why.startswith("host")
                else _refusal(module, topology, batch_size, planning, optimizer, reservation, limits)
            )
        planner = make_planner(
            topology,
            batch_size=batch_size,
            constraints=planning,
            optimizer=optimizer,
            storage_reservation=reservation,
            limits=limits,
            host_tier=req,
        )
        return _run_planner(
            planner,
            module,
            topology,
            sharders,
            pg,
            lambda: _refusal(module, topology, batch_size, planning, optimizer, reservation, limits),
        )

    try:
        made = attempt(requests)
    except PlanDoesNotFit as e:
        if host_tier != host_tier_plan.AUTO or one_memory:
            raise
        made, requests = host_tier_plan.auto_host_tier(
            host_tier_plan.eligible_tables(module),
            attempt,
            requests,
            fits=fits,
            curves=limits.hot_rows if limits is not None else {},
            samples=batch_size * topology.world_size,
            pooling={n: sum(c.pooling_factors or [1.0]) for n, c in (constraints or {}).items()},
            refusal=e,
        )
    choice.mark_host_tier(made, requests)
    if topology.compute_device == DeviceKind.TPU:
        place_on_own_device(made, "tpu")  # TorchRec numbers devices by local rank; TorchTPU's is always 0
    return made


def _run_planner(
    planner: EmbeddingShardingPlanner,
    module: nn.Module,
    topology: Topology,
    sharders: List[ModuleSharder[nn.Module]],
    pg: dist.ProcessGroup | None,
    refusal: Callable[[], str],
) -> ShardingPlan:
    """TorchRec's planner run (collectively with `pg`); PlanDoesNotFit with `refusal()` when no
    placement fits, SearchBoundReached when the proposers stopped at their bound first."""
    try:
        if pg is not None and torch.distributed.is_initialized():
            return planner.collective_plan(module, sharders, pg)
        return planner.plan(module, sharders)
    except PlannerError as e:
        if bound_reached(planner._proposers):
            raise SearchBoundReached(
                f"no placement of the {len(_table_configs(module))} tables on {spec_of(topology).name} found within "
                f"the planner's bound ({NO_FIT_FACTOR} x {DEFAULT_SHARD_BUDGET:,} shards per proposer, "
                "tpurec/planner/proposal_budget.py); they may still fit: try a larger slice, or fewer tables"
            ) from e
        raise PlanDoesNotFit(refusal()) from e


def _fits_by_bytes(
    module: nn.Module,
    topology: Topology,
    batch_size: int,
    optimizer: str,
    reservation: TpuStorageReservation,
    requests: Dict[str, CacheParams],
) -> str | None:
    """Whether weights and optimizer state alone leave room on the slice (the host tier's tables
    counted as their caches on the device and whole in host memory): None, else what is short
    ("device ..." or "host ...")."""
    from tpurec.planner.host_memory import HOST_HEADROOM_FRACTION
    from tpurec.planner.host_tier_plan import host_fit_problem, lower_bounds

    on_cpu = topology.compute_device == DeviceKind.CPU
    caps = [d.storage.ddr if on_cpu else d.storage.hbm for d in topology.devices]
    free = sum(c - reservation.amount(module, batch_size, c) for c in caps)
    device, host = lower_bounds(
        _table_configs(module),
        optimizer,
        lambda cfg: table_elem_bytes(cfg.data_type, topology.compute_device),
        requests,
        one_memory=on_cpu,
    )
    if device > free:
        return f"device memory: {device} > {free}"
    host_free = 0 if on_cpu else int(sum(d.storage.ddr for d in topology.devices) * (1 - HOST_HEADROOM_FRACTION))
    return host_fit_problem(host, host_free) if host else None


def uneven_buckets(module: nn.Module, world_size: int) -> str | None:
    """A managed-collision table whose remap's buckets (`total_num_buckets` of TorchRec's multi-probe
    hash remap) do not divide among the ranks, as TorchRec's planner requires: the problem named, or None.
    A one-bucket remap (MCHManagedCollisionModule's) shards row-wise like any table (`_get_num_buckets`)."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    for path, m in module.named_modules():
        if not isinstance(m, BaseManagedCollisionEmbeddingCollection):
            continue
        for table, buckets in m._managed_collision_collection.table_to_number_buckets().items():
            if buckets > 1 and buckets % world_size:
                return (
                    f"{path}: table {table}'s remap has {buckets} buckets, which {world_size} ranks cannot share "
                    f"evenly; make total_num_buckets of its HashZchManagedCollisionModule a multiple of {world_size}"
                )
    return None


def _lower_bound_bytes(module: nn.Module, optimizer: str, compute_device: str = "tpu") -> int:
    """Weights + optimizer state of every table, unpadded, all resident: no plan can need less."""
    from tpurec.planner.host_tier_plan import lower_bounds

    elem = lambda cfg: table_elem_bytes(cfg.data_type, compute_device)  # noqa: E731
    return lower_bounds(_table_configs(module), optimizer, elem, {}, one_memory=False)[0]


__all__ = [
    "plan",
    "make_planner",
    "PlanDoesNotFit",
    "TpuPlanningSharder",
    "TpuPlanningECSharder",
    "planning_sharders",
    "TpuEnumerator",
    "TpuPlanningMCEBCSharder",
    "TpuPlanningMCECSharder",
    "TpuStorageReservation",
    "infer_optimizer",
    "pooling_constraints",
]
