"""`tpurec.DistributedModelParallel`: TorchRec's DMP with tpurec's planner and SparseCore sharder.

A thin subclass. What it adds over torchrec.distributed.DistributedModelParallel:

* `device` may be "tpu", "tpu:0", "cpu", "cpu:0" or a torch.device (TorchRec's DMP crashes on a
  string). "tpu" on a host without a usable TPU fails at once, naming what is missing;
* when no plan is given, tpurec's TPU-aware planner plans (real HBM accounting, SparseCore and ICI
  costs), steered by `constraints` (ParameterConstraints by table name) and `topology` (a slice
  name such as "v5p-8", or a torchrec Topology);
* EmbeddingBagCollections are sharded onto the SparseCore kernel (CPU reference off TPU), with
  the fused optimizer set by `apply_optimizer_in_backward` on the unsharded model;
* without an initialised process group, a single-process gloo group is created, so a laptop dry
  run needs no launcher;
* torch's thread count is set once per process to the cores divided among the host's ranks, unless
  the user chose one (`threads=`, TPUREC_THREADS, OMP_NUM_THREADS, torch.set_num_threads;
  tpurec/runtime/threads.py).

Everything else (forward, state_dict with ShardedTensors, fused_optimizer, TrainPipelineSparseDist,
`model.plan`) is TorchRec's own.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import BaseEmbeddingSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.model_parallel import DistributedModelParallel as _TorchrecDMP
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from tpurec.embedding.settings import KernelSettings, TableLimits
from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.errors import UserError
from tpurec.runtime import heartbeat, process_group, run_report
from tpurec.runtime.device import DeviceKind, device_kind
from tpurec.runtime.library_notices import quiet_fx_tracing_notice
from tpurec.sharding import sharded_tensor_device  # noqa: F401  (ShardedTensor.device on the TPU path)
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.fp_sharder import SparseCoreFPEBCSharder
from tpurec.sharding.mc_sharder import SparseCoreMCEBCSharder, SparseCoreMCECSharder
from tpurec.sharding.sharder import SparseCoreEBCSharder

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import ParameterConstraints, Topology

logger = logging.getLogger(__name__)

# Batch size per device the planner assumes when the caller gives none (it sizes activations and
# SparseCore buffers, not the tables).
DEFAULT_PLANNING_BATCH_SIZE = 512


def process_group_backend(device_type: DeviceKind) -> str:
    """The c10d backend for tensors on `device_type`.

    gloo has no backend for tpu tensors, so on a TPU the group pairs gloo (CPU tensors, which
    TorchRec's pipelines still exchange) with TorchTPU's `tpu_dist`, which torch-tpu 0.2.0 registers
    for device "tpu" (torch_tpu/_loader.py, `Backend.register_backend("tpu_dist", ..., devices=["tpu"])`).
    """
    return "cpu:gloo,tpu:tpu_dist" if device_type == DeviceKind.TPU else "gloo"


def _ensure_process_group(device_type: DeviceKind = DeviceKind.CPU) -> None:
    if dist.is_initialized():
        return
    backend = process_group_backend(device_type)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        from datetime import timedelta

        # Launched by torchrun (or another env:// launcher): join its ranks, do not run alone.
        # TPUREC_DIST_TIMEOUT bounds a collective's wait (gloo's default is 30 minutes).
        seconds = heartbeat.seconds_from_env(heartbeat.DIST_TIMEOUT_ENV, heartbeat.DEFAULT_DIST_TIMEOUT)
        logger.info("tpurec: joining the launched ranks through env:// (%s)", backend)
        process_group.init(backend, timeout=timedelta(seconds=seconds) if seconds else None)
        return
    logger.info("tpurec: no process group; starting a single-process %s group for a local run", backend)
    # One process needs no network: an in-memory store (TorchTPU's uneven all-to-all needs a c10d Store,
    # ProcessGroupTpu::alltoall_base, and a HashStore is one). A TCP store opened a socket, which a TPU VM
    # sandbox may refuse (seen on the v5e chip, ../shared/tpu-vm/README.md).
    from tpurec.runtime import local_group

    if local_group.sockets_refused():  # gloo binds a socket even alone: a group that needs none
        local_group.register()
        backend = local_group.BACKEND
    process_group.init(backend, store=dist.HashStore(), rank=0, world_size=1)


# DistributedModelParallel(id_limits=...): a limits file, or limits by table name (TableLimits or
# their positional tuples)
IdLimitsArg = str | os.PathLike | dict[str, TableLimits | tuple[int, ...]] | None


def default_sharders(num_sparsecores: int, **sharder_kwargs: Any) -> List[ModuleSharder[nn.Module]]:
    """tpurec's sharders for EmbeddingBagCollection, EmbeddingCollection, the feature-processed
    EmbeddingBagCollection and the managed-collision EBC/EC, TorchRec's defaults for every other module type."""
    ebc = SparseCoreEBCSharder(num_sparsecores=num_sparsecores, **sharder_kwargs)
    ec = SparseCoreECSharder(num_sparsecores=num_sparsecores, **sharder_kwargs)
    ours = [
        ebc,
        ec,
        SparseCoreFPEBCSharder(ebc_sharder=ebc),
        SparseCoreMCEBCSharder(ebc_sharder=ebc),
        SparseCoreMCECSharder(ec_sharder=ec),
    ]
    mine = {s.module_type for s in ours}
    return ours + [s for s in get_default_sharders() if s.module_type not in mine]


def _pooling_factors(constraints: Dict[str, ParameterConstraints] | None) -> Dict[str, float] | None:
    """Ids per sample by table from ParameterConstraints that state pooling factors."""
    out = {
        name: float(sum(c.pooling_factors))
        for name, c in (constraints or {}).items()
        if getattr(c, "pooling_factors", None)
    }
    return out or None


def _swap_torchrec_sharders(sharders: List[ModuleSharder[nn.Module]], num_sc: int) -> List[ModuleSharder[nn.Module]]:
    """TorchRec's own EBC / EC / FP-EBC sharders (as TorchRec's examples pass them) become tpurec's SparseCore
    sharders with the same fused params and qcomms, said once; any other sharder is kept."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    ours = {
        EmbeddingBagCollectionSharder: SparseCoreEBCSharder,
        EmbeddingCollectionSharder: SparseCoreECSharder,
        FeatureProcessedEmbeddingBagCollectionSharder: SparseCoreFPEBCSharder,
    }
    out: List[ModuleSharder[nn.Module]] = []
    for s in sharders:
        if type(s) in (ManagedCollisionEmbeddingBagCollectionSharder, ManagedCollisionEmbeddingCollectionSharder):
            # TorchRec's MC sharders around their inner sharder: the inner one swapped, the remap's kept
            mc = cast(Any, s)
            (inner,) = _swap_torchrec_sharders([mc._e_sharder], num_sc)
            wrap = SparseCoreMCEBCSharder if isinstance(inner, SparseCoreEBCSharder) else SparseCoreMCECSharder
            out.append(cast(ModuleSharder[nn.Module], wrap(inner, mc._mc_sharder, s.qcomm_codecs_registry)))  # type: ignore[arg-type]
            continue
        replacement = ours.get(type(s))
        if replacement is None:
            _refuse_torchrec_subclass(s, {**ours, **_MC_REPLACEMENTS})
            out.append(s)
            continue
        logger.warning(
            "tpurec: %s replaced by tpurec.sharding.%s (same fused_params and qcomms): tpurec shards "
            "embedding tables onto its SparseCore kernel",
            type(s).__name__,
            replacement.__name__,
        )
        out.append(
            replacement(
                num_sparsecores=num_sc,
                fused_params=cast(BaseEmbeddingSharder, s).fused_params,  # the sharders replaced are all embedding ones
                qcomm_codecs_registry=s.qcomm_codecs_registry,
            )
        )
    return out


# TorchRec's managed-collision sharders and what tpurec shards their modules with (named in messages)
_MC_REPLACEMENTS = {
    "ManagedCollisionEmbeddingBagCollectionSharder": "mc_sharder.SparseCoreMCEBCSharder",
    "ManagedCollisionEmbeddingCollectionSharder": "mc_sharder.SparseCoreMCECSharder",
}


def _refuse_torchrec_subclass(sharder: ModuleSharder[nn.Module], ours: dict) -> None:
    """A user's subclass of one of TorchRec's embedding sharders (`ours`: TorchRec's class, or its
    name, -> tpurec's) shards onto FBGEMM's kernels, and swapping it for tpurec's would drop what the
    subclass overrides: refused in one line naming the class and what to derive from instead."""
    if any(c.__module__.split(".")[0] == "tpurec" for c in type(sharder).__mro__):
        return  # tpurec's own sharders (and the user's subclasses of them) derive from TorchRec's
    for base in type(sharder).__mro__[1:]:
        theirs = ours.get(base, ours.get(base.__name__)) if base.__module__.startswith("torchrec.") else None
        if theirs is not None:
            name = theirs if isinstance(theirs, str) else f"{theirs.__module__.split('.')[-1]}.{theirs.__name__}"
            raise UserError(
                f"sharders=[{type(sharder).__name__}(...)]: a subclass of TorchRec's {base.__name__} shards onto "
                f"FBGEMM's kernels, which tpurec does not run, and swapping it for tpurec's would drop what it "
                f"overrides; derive it from tpurec.sharding.{name} instead (the same arguments), or pass "
                f"TorchRec's {base.__name__} itself, which tpurec swaps"
            )


def _read_id_limits(
    id_limits: IdLimitsArg,
    module: nn.Module,
    world_size: int,
    num_sc: int,
    batch_size: int | None,
) -> dict[str, TableLimits] | None:
    """{table: TableLimits} (KernelSettings.id_limits) from `id_limits`: a limits file (`tpurec
    data stats`), read here and only here (only DMP knows the layout it must match), refused unless
    measured for this layout and for the module's tables; or a dict of TableLimits or of their
    positional tuples, checked; None: none given."""
    if id_limits is None:
        return None
    from tpurec.planner.id_limits import check_id_limits, load_limits
    from tpurec.planner.plan_check import embedding_tables

    if isinstance(id_limits, dict):  # each limit checked like a flag, the table and field named
        return check_id_limits(id_limits)

    if batch_size is None:
        raise UserError("id_limits from a file need batch_size= (the batch per device they were measured for)")
    layout = {"world_size": world_size, "sparsecores_per_device": num_sc, "batch_size_per_device": batch_size}
    # measured for another model, they would bound none of its tables without a word
    return load_limits(str(id_limits), layout, tables=embedding_tables(module))


def _host_tier_choice(host_tier: str | None, plan: ShardingPlan | None, compute_device: DeviceKind) -> str | None:
    """`host_tier="auto"`: a model whose tables do not fit the slice's device memory is planned with
    tables moved to the host tier (planner/host_tier_plan.py), where host memory allows; None/"off":
    refused as before. Only DMP's own planning, only on a TPU (a CPU rank has one memory)."""
    from tpurec.planner.host_tier_plan import AUTO

    if host_tier in (None, "off"):
        return None
    if host_tier != AUTO:
        raise UserError(f"host_tier= takes 'auto' or None, got {host_tier!r}")
    if plan is not None:
        raise UserError("host_tier='auto' plans the tables onto the host tier; the given plan holds its own")
    if compute_device != DeviceKind.TPU:
        raise UserError("host_tier='auto' moves tables off a TPU's HBM; on the CPU name them (ParameterConstraints)")
    return AUTO


def _quiet_sharded_tensor_notice() -> None:
    """Drops torch's "Please use DTensor instead and we are deprecating ShardedTensor" FutureWarning of
    DCP: TorchRec's sharded modules hold their tables as ShardedTensors (its design, not the user's
    choice), so every `dcp.save` / `dcp.load` of a DMP's state dict printed it per rank. That message
    from torch.distributed.checkpoint only; the user's own warnings are untouched."""
    import warnings

    warnings.filterwarnings(
        "ignore",
        message="Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning,
        module=r"torch\.distributed\.checkpoint\.",
    )


class QuietDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's DDP wrapping of the dense modules, without its FutureWarning on every rank.

    TorchRec 1.9.2 passes `broadcast_buffers=False` to DDP (torchrec/distributed/model_parallel.py),
    which torch 2.14 deprecates for `forward_sync_buffers`; that one also syncs buffers at init, which
    TorchRec's choice does not, so tpurec keeps TorchRec's call and silences that one warning, by
    category, message and module, for the wrap only (docs/dmp.md).
    """

    def wrap(self, dmp: _TorchrecDMP, env: ShardingEnv, device: torch.device) -> None:
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():
            # attributed to TorchRec's call, or to the emulated device's DDP.__init__ in between
            # (tpurec/emulation/torchtpu_dist.py), which calls it on TorchRec's behalf
            warnings.filterwarnings(
                "ignore",
                message="`broadcast_buffers` is deprecated",
                category=FutureWarning,
                module=r"(torchrec\.distributed\.model_parallel|tpurec\.emulation\.torchtpu_dist)$",
            )
            super().wrap(dmp, env, device)
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, DistributedDataParallel) and ddp.device.type not in (DeviceKind.CPU, "cuda"):
            ddp.logger = cast(Any, _NoRuntimeStats(ddp.logger))  # duck-typed: DDP only calls its methods


class _NoRuntimeStats:
    """DDP's logger, without its runtime stats on a device other than CPU and CUDA (the TPU, real or
    emulated): torch times DDP's iterations with a timer registered per device type in C++ only, so on
    the TPU `set_runtime_stats_and_log` (called by DDP's forward) measures nothing and prints "Time
    stats are currently only collected for CPU and CUDA devices" from C++ on every rank, past any
    Python filter. Everything else goes to torch's logger."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def set_runtime_stats_and_log(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class TpuDataParallelWrapper(QuietDataParallelWrapper):
    """TorchRec's DDP wrapping of the dense modules, without DDP's parameter-shape check.

    `DistributedDataParallel.__init__` runs `_verify_param_shape_across_processes`, a device->CPU
    copy that fails on multi-host TorchTPU 0.2.0 ("transfer to 'cpu' device failed", torchrec PR
    #4597). The check only guards against ranks building different models; DMP's dense modules are
    the same on every rank by construction. Skipped as torchrec's MLPerf TPU benchmark skips it: the
    name is replaced in DDP's own module, where `__init__` looks it up, for the wrap only.
    """

    def wrap(self, dmp: _TorchrecDMP, env: ShardingEnv, device: torch.device) -> None:
        import torch.nn.parallel.distributed as ddp

        saved = ddp._verify_param_shape_across_processes
        ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
        try:
            super().wrap(dmp, env, device)
        finally:
            ddp._verify_param_shape_across_processes = saved
        _skip_one_rank_all_reduce(dmp._dmp_wrapped_module)


ONE_RANK_ALL_REDUCE_SWITCH = "TPUREC_ONE_RANK_ALL_REDUCE"


def _skip_one_rank_all_reduce(ddp: nn.Module) -> None:
    """On a one-rank TPU job, DDP's gradients go to the optimizer without the all-reduce.

    DDP's default divides each gradient bucket by the world size and all-reduces it: on one rank both
    leave the numbers as they are (x / 1 and a sum over one rank are exact), but on TorchTPU each is an
    op of its own for every bucket and step (a TensorCore program and a `c10d::allreduce_` collective,
    docs/tpu.md "every op is a program"). torch's `noop_hook` hands DDP the bucket as it is instead.
    TPUREC_ONE_RANK_ALL_REDUCE=1 keeps DDP's default (to measure the difference, docs/dmp.md).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel) or ddp.process_group.size() != 1:
        return
    if os.environ.get(ONE_RANK_ALL_REDUCE_SWITCH, "") not in ("", "0"):
        return
    ddp.register_comm_hook(None, noop_hook)


class DistributedModelParallel(_TorchrecDMP):
    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str | None = None,
        env: ShardingEnv | None = None,
        plan: ShardingPlan | None = None,
        sharders: List[ModuleSharder[nn.Module]] | None = None,
        constraints: Dict[str, ParameterConstraints] | None = None,
        topology: Topology | str | None = None,
        *,
        batch_size: int | None = None,
        uneven_all_to_all: str | None = None,
        id_limits: IdLimitsArg = None,
        fixed_limits: bool | None = None,
        threads: int | None = None,
        host_tier: str | None = None,
        **dmp_kwargs: Any,
    ) -> None:
        from tpurec.planner.topology import make_topology
        from tpurec.runtime import threads as torch_threads
        from tpurec.sharding import tpu_all_to_all

        # Torch's start-up count is one thread per core for every rank: cores / local ranks instead,
        # once, unless the user chose a count (tpurec/runtime/threads.py).
        torch_threads.apply(threads)
        quiet_fx_tracing_notice()
        _quiet_sharded_tensor_notice()

        torch_device, compute_device = _start_device(device, module, uneven_all_to_all)
        if env is None:
            world = dist.group.WORLD
            assert world is not None  # _ensure_process_group above
            env = ShardingEnv.from_process_group(world)
        if topology is None or isinstance(topology, str):
            topology = make_topology(topology, world_size=env.world_size, compute_device=compute_device)
        num_sc = _num_sparsecores(topology, compute_device, torch_device)
        # The tables' expected ids per sample (ParameterConstraints.pooling_factors, summed over a
        # table's features) also place each stack's tables so its SparseCore partitions share the
        # ids (tpurec/embedding/stack_order.py); given sharders carry their own `pooling_factors`.
        # The kernel settings DMP decides (the measured limits), built once and carried whole by the
        # sharders to every kernel.
        # fixed_limits=True: every buffer shape fixed, as on a TPU (and the EmbeddingCollections' outputs
        # on their fixed-shape path, which CompiledStep and PipelinedStep need); the default sharders only.
        if fixed_limits is not None and sharders:
            raise UserError("fixed_limits= sets the default sharders' limits: give it to your sharders instead")
        limits = _read_id_limits(id_limits, module, env.world_size, num_sc, batch_size)
        settings = KernelSettings(id_limits=limits, fixed_limits=fixed_limits)
        sharders = (
            _swap_torchrec_sharders(sharders, num_sc)
            if sharders
            else default_sharders(num_sc, pooling_factors=_pooling_factors(constraints), settings=settings)
        )
        auto = _host_tier_choice(host_tier, plan, compute_device)
        if plan is None:
            from tpurec.planner.planners import plan as make_plan

            # tables whose constraints name `fused_uvm_caching` go on the host tier (docs/host_tier.md)
            plan = make_plan(
                module,
                topology,
                batch_size=batch_size or DEFAULT_PLANNING_BATCH_SIZE,
                constraints=constraints,
                sharders=sharders,
                pg=env.process_group,
                host_tier=auto,
            )
        else:
            plan = _checked_plan(plan, module, env.world_size, compute_device)
        if torch_device.type in tuple(DeviceKind):
            from tpurec.planner.plan_check import place_on_own_device

            place_on_own_device(plan, torch_device.type)  # "rank:R/cpu", or "rank:R/tpu:0" on every TPU rank
        all_to_all = None
        if compute_device == DeviceKind.TPU:
            # TorchRec's padding of uneven all-to-alls on the device (tpu_all_to_all.py).
            all_to_all = tpu_all_to_all.select(uneven_all_to_all)
            dmp_kwargs.setdefault("data_parallel_wrapper", TpuDataParallelWrapper())
        dmp_kwargs.setdefault("data_parallel_wrapper", QuietDataParallelWrapper())
        # the planner's reservation beside the shards, on the module before sharding (the plan report's
        # reserved bytes: tpurec train's planned HBM beside the device's bytes in use, issue #59)
        reserved = planned_reserved_bytes(
            module, topology, batch_size or DEFAULT_PLANNING_BATCH_SIZE, constraints, plan
        )
        super().__init__(module, env=env, device=torch_device, plan=plan, sharders=sharders, **dmp_kwargs)
        self.topology = topology
        self.planned_reserved_bytes = reserved
        # With TorchTPU's handshake of compiled collective graphs on, the ranks' graphs must be the same
        # code to stay one program: their fixed id limits made equal (rank_limits.py). Stacks raised here.
        self.limits_aligned = 0
        if compute_device == DeviceKind.TPU and env.world_size > 1:
            from tpurec.sharding.rank_limits import align_fixed_limits, handshake_on

            if handshake_on():
                self.limits_aligned = align_fixed_limits(self, env.process_group or dist.group.WORLD)
        self.uneven_all_to_all = all_to_all  # "padded" on the TPU path, else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A training step (training mode, gradients on) or an evaluation pass, for the end-of-run checks
        # of a program `tpurec launch` runs (tpurec/runtime/run_report.py): on an emulated rank its
        # device's ops belong to it.
        run_report.forward(self.training and torch.is_grad_enabled())
        return super().forward(*args, **kwargs)


def planned_reserved_bytes(
    module: nn.Module,
    topology: Topology,
    batch_size: int,
    constraints: Dict[str, ParameterConstraints] | None,
    plan: ShardingPlan,
) -> int | None:
    """Bytes the planner reserves on each device of `topology` for `module` (unsharded) beside its
    embedding shards (planners.TpuStorageReservation: dense model, pooled embeddings, headroom, the
    TensorCore update's stack copy and work), as `tpurec plan`'s report counts them; None where it
    cannot say (the figure is informative: a run never fails on it)."""
    from tpurec.planner.estimators import spec_of
    from tpurec.planner.host_tier_choice import host_tier_tables
    from tpurec.planner.plan_check import module_plans
    from tpurec.planner.planners import TpuStorageReservation, infer_optimizer

    try:
        reservation = TpuStorageReservation()
        reservation.optimizer = infer_optimizer(module)
        reservation.host_tier = {n: c for p in module_plans(plan).values() for n, c in host_tier_tables(p).items()}
        cap = spec_of(topology).generation.hbm_bytes  # as the report of `tpurec plan` takes it
        return reservation.device_bytes(topology, batch_size, module, cap, constraints)
    except Exception:  # noqa: BLE001 (an informative figure)
        return None


def _start_device(
    device: torch.device | str | None, module: nn.Module, uneven_all_to_all: str | None
) -> tuple[torch.device, DeviceKind]:
    """The torch device and the kind of code path (tpu, cpu) DMP shards onto, once the process group
    (and, when asked for, the heartbeat) runs; a module or all-to-all the TPU path cannot run is
    refused first."""
    from tpurec.embedding.backend import select_device
    from tpurec.sharding import tpu_all_to_all

    torch_device = select_device(device)  # raises at once for "tpu" without a TPU
    if torch_device.type == "meta":
        raise UserError("device='meta' is for building the unsharded model; shard onto 'tpu' or 'cpu'")
    # The TPU code path: a tpu device, or an emulated TPU rank's CPU (tpurec.emulation).
    compute_device = device_kind(torch_device.type)
    # "uneven" is refused on the TPU path, before any group or plan is made (tpu_all_to_all.py).
    tpu_all_to_all.check(uneven_all_to_all, compute_device)
    if compute_device == DeviceKind.TPU:
        from tpurec.sharding.tpu_ops_check import refuse_modules_without_tpu_kernels

        # A TorchRec module whose forward needs an op TorchTPU lacks: told now, not at its first step.
        refuse_modules_without_tpu_kernels(module)
    _ensure_process_group(compute_device)
    if os.environ.get(heartbeat.TIMEOUT_ENV):
        # Opt-in for library users (it ends the process when a neighbour goes silent);
        # `tpurec train` starts it itself, by default.
        heartbeat.start()
    return torch_device, compute_device


def _num_sparsecores(topology: Topology, compute_device: DeviceKind, torch_device: torch.device) -> int:
    """SparseCores per device: the TPU's own count (a topology planned for another is refused), else
    the topology's."""
    slice_spec: Any = getattr(topology, "spec", None)  # tpurec's topologies carry their SliceSpec
    planned_sc = getattr(getattr(slice_spec, "generation", None), "sparsecores", None)
    if compute_device == DeviceKind.TPU:
        # The chip decides (TorchTPU's ops use its own count); a plan for another generation is refused.
        num_sc = resolve_num_sparsecores(None, "tpu")
        if planned_sc and planned_sc != num_sc:
            raise UserError(
                f"the topology {slice_spec.name} has {planned_sc} SparseCores per device but "
                f"this TPU has {num_sc}; plan for this host's TPU generation"
            )
    else:
        num_sc = resolve_num_sparsecores(planned_sc or None, torch_device.type)
    return num_sc


def _checked_plan(plan: ShardingPlan, module: nn.Module, world_size: int, compute_device: DeviceKind) -> ShardingPlan:
    """A given plan fitted to the model and checked (tpurec/planner/plan_check.py)."""
    from tpurec.planner.plan_check import (
        adopt_compute_kernels,
        align_to_model,
        check_managed_collision_row_wise,
        check_plan,
        check_plan_for_tpu,
        check_sharding_types,
        embedding_tables,
    )

    # A given plan must fit this model and world size (else TorchRec fails deep inside, or
    # shards onto ranks that do not exist); plans from `tpurec plan` are keyed by table names.
    plan = align_to_model(plan, module)
    check_plan(plan, embedding_tables(module), world_size)
    check_sharding_types(plan)
    check_managed_collision_row_wise(plan, module)
    moved = adopt_compute_kernels(plan, embedding_tables(module))
    if moved:
        logger.warning(
            "tpurec: the plan puts %d table(s) on TorchRec's own kernels (%s): run on tpurec's SparseCore "
            "kernel instead, with the same sharding",
            len(moved),
            ", ".join(moved[:8]) + (f" and {len(moved) - 8} more" if len(moved) > 8 else ""),
        )
    if compute_device == DeviceKind.TPU:
        check_plan_for_tpu(plan)
    return plan
