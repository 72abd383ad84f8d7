"""What one embedding shard costs on a TPU device: HBM bytes and step time.

`shard_cost` is the single cost model; the torchrec estimator classes below and the inspector
both call it, so the planner optimises exactly what `tpurec plan` prints. Formulas and their
assumptions are written out in docs/planner.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Dict, List

import torch
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import ShardingType

from tpurec.embedding import dtypes
from tpurec.embedding.constraints import (
    DIM_ALIGN,
    csr_buffer_bytes,
    padded_rows,
    round_up,
    worst_case_max_ids_per_partition,
)
from tpurec.embedding.optimizers.registry import spec_class
from tpurec.planner import cpu_cost, tensorcore_cost
from tpurec.planner.id_limits import IdLimits
from tpurec.planner.shard_costs import ShardCost
from tpurec.planner.topology import CPU_GENERATION, SliceSpec, cpu_spec
from tpurec.runtime.device import DeviceKind, tensorcore_only

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import SharderDataMap
    from torchrec.distributed.types import CacheParams
    from torchrec.types import DataType

ID_BYTES = 4  # int32 ids on the wire and in the SparseCore buffers
ACTIVATION_BYTES = 4  # pooled outputs and their gradients are float32 for every table dtype
WEIGHT_BYTES = 4  # a weighted table's per-id weights (float32) travel with the ids
ROW_WISE = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def _collective_ms(
    nbytes: float, group: int, spec: SliceSpec, spans_slices: bool, collective: str = "all_to_all"
) -> float:
    """Time for a device to exchange `nbytes` with a group of `group` devices.

    The (group-1)/group share that leaves the device goes over ICI at the all-to-all efficiency;
    when the group spans slices, the (S-1)/S share bound for other slices goes over DCN instead.
    The two are summed (no overlap assumed, a conservative choice). On a TPU every `collective`
    kind is priced alike (no per-kind ICI efficiency is published). CPU ranks: gloo's measured
    bytes per second of that kind (cpu_cost.transfer_ms; gloo's reduce-scatter and all-gather
    measured 3-4x slower than its all-to-all for the same bytes).
    """
    if group <= 1 or nbytes == 0:
        return 0.0
    if spec.cpu_costs is not None:
        return cpu_cost.transfer_ms(nbytes, group, spec.cpu_costs, collective)
    gen = spec.generation
    outgoing = nbytes * (group - 1) / group
    ici = gen.ici_bw_per_chip / gen.devices_per_chip * spec.a2a_efficiency
    slices = spec.num_slices if spans_slices else 1
    dcn = spec.dcn_bw_per_host / spec.devices_per_host
    seconds = outgoing / slices / ici + (outgoing * (slices - 1) / slices / dcn if slices > 1 else 0.0)
    return seconds * 1e3


def shard_cost(
    *,
    sharding_type: str,
    rows: int,
    cols: int,
    pooling_factor: float,
    batch_per_device: int,
    world_size: int,
    num_shards: int,
    spec: SliceSpec,
    optimizer: str,
    elem_bytes: int = 4,
    pooled: bool = True,
    num_features: int = 1,
    weighted: bool = False,
    max_ids_per_partition: int | None = None,
) -> ShardCost:
    """Cost of one shard of `rows` x `cols` on its device.

    `num_shards` counts the table's shards (the row-shard group for RW/TWRW). `elem_bytes`: bytes per
    stored table element (`table_elem_bytes`: 2 for FP16 on CPU, 4 where a TPU widens it).
    `pooling_factor` is the ids per sample over all `num_features` features the table serves; each
    feature is pooled into its own output row and sends its own lengths. `weighted`: every id also
    carries a float32 weight on the wire.
    `pooled` False: a sequence table (EmbeddingCollection), whose output is one row per id, so
    activations and the output collectives scale with ids (`pooling_factor` = mean sequence length).
    `max_ids_per_partition`: the SparseCore buffers' limit (measured, `tpurec data stats`); None: the
    worst case, every id of a SparseCore's sample slice in one partition.
    """
    ns = max(1, spec.generation.sparsecores)
    samples = batch_per_device * world_size  # every shard serves the global batch
    local_rows = padded_rows(rows, ns)
    width = round_up(cols, DIM_ALIGN)  # rows are stored padded to the SparseCore's 8 floats
    weights = local_rows * width * elem_bytes
    state_bytes = spec_class(optimizer).state_bytes_per_row(width)  # `optimizer` is a registry name
    opt = state_bytes * local_rows
    max_ids = max_ids_per_partition or worst_case_max_ids_per_partition(samples, pooling_factor, ns)
    buffers = csr_buffer_bytes(max_ids, ns)
    row_group = num_shards if sharding_type in ROW_WISE else 1
    # Pooled: one row per sample and feature. Unpooled: one row per id, and a row shard only returns
    # its own ids' rows.
    out_rows = samples * num_features if pooled else samples * pooling_factor / row_group
    pooled_bytes = out_rows * cols * ACTIVATION_BYTES
    id_bytes = ID_BYTES + (WEIGHT_BYTES if weighted else 0)

    if sharding_type == ShardingType.DATA_PARALLEL.value:
        # Only to score torchrec's own plans: every rank holds the table and serves its own batch;
        # backward all-reduces the dense table gradient.
        ids = batch_per_device * pooling_factor
        pooled_bytes = batch_per_device * cols * ACTIVATION_BYTES * (num_features if pooled else pooling_factor)
        grad_ms = 2 * _collective_ms(rows * cols * elem_bytes, world_size, spec, True)
        in_ms = out_ms = 0.0
    else:
        ids = samples * pooling_factor / row_group  # ids spread uniformly over row shards
        # ids (and lengths) come from every rank, across slices if there are several.
        lengths = samples * num_features * ID_BYTES / row_group
        in_ms = _collective_ms(ids * id_bytes + lengths, world_size, spec, True)
        if sharding_type == ShardingType.TABLE_ROW_WISE.value:
            # partial sums reduce-scattered inside the host group (ICI), then each device sends its
            # 1/n of the pooled rows to every rank; backward all-gathers the gradient in the group
            tail = _collective_ms(pooled_bytes / row_group, world_size, spec, True)
            out_ms = _collective_ms(pooled_bytes, row_group, spec, False, "reduce_scatter") + tail
            grad_ms = _collective_ms(pooled_bytes, row_group, spec, False, "all_gather") + tail
        elif sharding_type == ShardingType.ROW_WISE.value and pooled:
            # reduce-scatter of partial sums over all ranks (the same volume per device as an
            # all-to-all); backward all-gathers the gradient (torchrec comm_ops.ReduceScatter*_Wait)
            out_ms = _collective_ms(pooled_bytes, world_size, spec, True, "reduce_scatter")
            grad_ms = _collective_ms(pooled_bytes, world_size, spec, True, "all_gather")
        else:
            # TW/CW/TWCW: all-to-all of the pooled rows and of their gradient; unpooled RW: all-to-all
            # of its ids' rows
            out_ms = grad_ms = _collective_ms(pooled_bytes, world_size, spec, True)
    sc_bw = spec.generation.hbm_bw * spec.sc_gather_fraction
    row_bytes = cols * elem_bytes
    lookup_ms = ids * row_bytes / sc_bw * 1e3
    # Fused update per id: read gradient, read + write the row, read + write optimizer state.
    update_ms = ids * (3 * row_bytes + 2 * state_bytes) / sc_bw * 1e3
    if tensorcore_only(spec.generation.name) and spec.cpu_costs is None:
        # The TensorCore kernel (v5e, v4) is bound by XLA's row gather and scatter, not by bytes:
        # priced from what its programs took on a v5e chip (tensorcore_cost, docs/planner.md).
        gen = spec.generation
        acc = tensorcore_cost.pooling_accumulators(gen.name, int(out_rows), cols) if pooled else None
        lookup_ms = tensorcore_cost.lookup_ms(ids, cols, gen.name, gen.hbm_bw, acc)
        update_ms = tensorcore_cost.update_ms(ids, cols, local_rows, optimizer, state_bytes, gen.name, gen.hbm_bw)
    if spec.cpu_costs is not None:
        # CPU reference kernel: the measured time per id (forward + fused backward together), split
        # between lookup and update in the proportion of the bytes above (only the sum is measured).
        total = cpu_cost.compute_ms(ids, cols, spec.cpu_costs)
        share = lookup_ms / (lookup_ms + update_ms) if lookup_ms + update_ms else 0.0
        lookup_ms, update_ms = total * share, total * (1 - share)
    # The fused update writes a new table and state, then copies them back. On a SparseCore TPU a
    # stack holds every table of a dim, so each shard's copy counts; the TensorCore kernel (v5e, v4)
    # cuts stacks at TENSORCORE_MAX_STACK_BYTES and updates them one by one: its one copy alive at a
    # time is reserved per device (planners.TpuStorageReservation), not per shard.
    one_stack = spec.generation.name == CPU_GENERATION or tensorcore_only(spec.generation.name)
    transient = 0 if one_stack else weights + opt
    return ShardCost(
        weights=weights,
        optimizer=opt,
        buffers=buffers,
        activations=int(2 * pooled_bytes),
        transient=transient,
        lookup_ms=lookup_ms,
        update_ms=update_ms,
        input_comm_ms=in_ms,
        output_comm_ms=out_ms,
        grad_comm_ms=grad_ms,
    )


def spec_of(topology: Topology) -> SliceSpec:
    """The tpurec SliceSpec of a topology; a CPU-like stand-in for plain torchrec topologies."""
    spec = getattr(topology, "spec", None)
    if spec is not None:
        return spec
    # Not a CPU host we measured (cpu_cost's terms): keep the nominal bandwidth model.
    return cpu_spec(topology.world_size, devices_per_host=topology.local_world_size, cpu_costs=None)


def table_elem_bytes(dtype: torch.dtype | DataType, compute_device: str) -> int:
    """Bytes per stored element of a table of `dtype` (torch dtype or TorchRec DataType): the config's
    dtype, or float32 where the device widens it (a TPU: tpurec.embedding.dtypes)."""
    if not isinstance(dtype, torch.dtype):
        from torchrec.modules.embedding_configs import data_type_to_dtype

        dtype = data_type_to_dtype(dtype)
    return dtypes.element_bytes(dtype, compute_device)


def option_costs(
    option: ShardingOption,
    spec: SliceSpec,
    world_size: int,
    optimizer: str,
    compute_device: str = "tpu",
    limits: IdLimits | None = None,
    cache: CacheParams | None = None,
) -> List[ShardCost]:
    """Each shard's cost; `cache`: the table is on the host tier with these CacheParams."""
    pooling = float(sum(option.input_lengths)) if option.input_lengths else 1.0
    is_weighted = getattr(option.module[1], "is_weighted", None)  # EmbeddingBagCollection.is_weighted()
    weighted = bool(is_weighted()) if callable(is_weighted) else False
    max_ids = (
        limits.max_ids(
            option.name,
            option.batch_size * world_size,
            pooling,
            max(1, spec.generation.sparsecores),
            pooled=option.is_pooled,
            features=max(1, len(option.input_lengths or [])),
        )
        if limits is not None
        else None
    )
    elem_bytes = table_elem_bytes(option.tensor.dtype, compute_device)
    # A shard's cost depends on its size only, and a row-wise option's shards share one or two sizes:
    # computed once per size, not once per device (enumeration was O(tables x devices) cost calls).
    by_size: Dict[tuple[int, int], ShardCost] = {}
    for shard in option.shards:
        size = (shard.size[0], shard.size[1])
        if size not in by_size:
            resident = functools.partial(
                shard_cost,
                sharding_type=option.sharding_type,
                cols=size[1],
                pooling_factor=pooling,
                batch_per_device=option.batch_size,
                world_size=world_size,
                num_shards=option.num_shards,
                spec=spec,
                optimizer=optimizer,
                elem_bytes=elem_bytes,
                pooled=option.is_pooled,
                num_features=max(1, len(option.input_lengths or [])),
                weighted=weighted,
                max_ids_per_partition=max_ids,
            )
            by_size[size] = (
                resident(rows=size[0])
                if cache is None
                else _host_tier_option_cost(
                    option,
                    size,
                    cache,
                    resident,
                    elem_bytes=elem_bytes,
                    optimizer=optimizer,
                    samples=option.batch_size * world_size,
                    pooling=pooling,
                    limits=limits,
                )
            )
    return [by_size[(shard.size[0], shard.size[1])] for shard in option.shards]


def _host_tier_option_cost(
    option: ShardingOption,
    size: tuple[int, int],
    cache: CacheParams,
    resident: Callable[..., ShardCost],
    *,
    elem_bytes: int,
    optimizer: str,
    samples: int,
    pooling: float,
    limits: IdLimits | None,
) -> ShardCost:
    """A host-tier shard of `size` of the option's table (host_tier_cost.py), `samples` a global batch."""
    from tpurec.planner.host_tier_cost import host_tier_shard_cost

    row_group = option.num_shards if option.sharding_type in ROW_WISE else 1
    return host_tier_shard_cost(
        resident,
        table=option.name,
        table_rows=int(option.tensor.shape[0]),
        shard_rows=size[0],
        cols=size[1],
        cache=cache,
        elem_bytes=elem_bytes,
        optimizer=optimizer,
        curve=limits.hot_rows.get(option.name) if limits is not None else None,
        samples=samples,
        shard_ids=samples * pooling / row_group,
    )


def shard_storage(cost: ShardCost, compute_device: str) -> Storage:
    """A shard's bytes where its device keeps them: HBM on a TPU, with a host-tier shard's rows in host
    DDR; a CPU rank keeps both in its one memory, DDR."""
    if compute_device == DeviceKind.CPU:
        return Storage(hbm=0, ddr=cost.bytes + cost.host)
    return Storage(hbm=cost.bytes, ddr=cost.host)


def shard_perf(cost: ShardCost) -> Perf:
    """A shard's step time in torchrec's terms: SparseCore lookup (fwd), fused update (bwd), collectives."""
    return Perf(
        fwd_compute=cost.lookup_ms,
        fwd_comms=cost.input_comm_ms + cost.output_comm_ms,
        bwd_compute=cost.update_ms,
        bwd_comms=cost.grad_comm_ms,
        input_dist_comms=cost.input_comm_ms,
        prefetch_compute=cost.host_ms,  # TorchRec's term for a cache's loads (its UVM caching kernel's)
    )


class _TpuEstimator(ShardEstimator):
    def __init__(
        self,
        topology: Topology,
        constraints: Dict[str, ParameterConstraints] | None = None,
        optimizer: str = "sgd",
        limits: IdLimits | None = None,
        host_tier: Mapping[str, CacheParams] | None = None,
    ) -> None:
        spec_class(optimizer)  # refuses an unknown name now, not at the first estimate
        self._limits = limits
        self._host_tier = dict(host_tier or {})  # tables on the host tier, by name, with their CacheParams
        self._topology = topology
        self._constraints = constraints
        self._optimizer = optimizer
        self._spec = spec_of(topology)

    def _costs(self, option: ShardingOption) -> List[ShardCost]:
        topo = self._topology
        cache = self._host_tier.get(option.name)
        return option_costs(
            option, self._spec, topo.world_size, self._optimizer, topo.compute_device, self._limits, cache
        )


class TpuStorageEstimator(_TpuEstimator):
    """HBM per shard: padded table + optimizer state + SparseCore buffers + pooled activations, and on
    a TPU the transient new table and state of the fused update."""

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: SharderDataMap | None = None) -> None:
        for option in sharding_options:
            for shard, cost in zip(option.shards, self._costs(option)):
                shard.storage = shard_storage(cost, self._topology.compute_device)


class TpuPerfEstimator(_TpuEstimator):
    """Step time per shard: SparseCore lookup (fwd), fused update (bwd) and the collectives."""

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: SharderDataMap | None = None) -> None:
        for option in sharding_options:
            for shard, cost in zip(option.shards, self._costs(option)):
                shard.perf = shard_perf(cost)
