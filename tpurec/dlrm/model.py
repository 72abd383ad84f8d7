"""Build the DLRM / DLRM-DCNv2 model, shard it, and give it its optimisers and LR schedule.

The model is torchrec's own (DLRM, DLRM_DCN, DLRMTrain); its tables are created on the meta device so
that only the shards each rank owns are ever allocated (by DistributedModelParallel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tpurec.data.catalog import NUM_DENSE, TableSet, get_table_set
from tpurec.dlrm.configs import DLRMConfig
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.keyed import CombinedOptimizer

    from tpurec.dlrm.zch import ZchSpec


def _optimizer(name: str, lr: float, eps: float) -> tuple[type, dict]:
    """(torch optimizer class, kwargs) of the named optimizer spec; eps is dropped by those without one.

    A fresh kwargs dict each call: apply_optimizer_in_backward adds keys to the one it is given.
    """
    from tpurec.embedding.optimizers.registry import spec_class

    return spec_class(name).from_hyperparameters(lr=lr, eps=eps).to_torch()


def embedding_bag_configs(table_set: TableSet) -> list[EmbeddingBagConfig]:
    """TorchRec's EmbeddingBagConfig (sum pooling) for every table of a catalog table set.

    Here rather than in tpurec.data.catalog, which stays plain data without torch."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=[t.feature],
            pooling=PoolingType.SUM,
        )
        for t in table_set.tables
    ]


class ZchEmbeddingBags(torch.nn.Module):
    """TorchRec's ManagedCollisionEmbeddingBagCollection as DLRM's SparseArch takes an EBC: its table
    configs, and a forward giving the pooled embeddings alone (the MC-EBC's is a pair with the remapped
    ids). `tpurec train --zch` (tpurec.dlrm.zch)."""

    def __init__(self, mc: Any) -> None:
        super().__init__()
        self.mc: Any = mc

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.mc._embedding_module.embedding_bag_configs()

    def forward(self, features: Any) -> Any:
        return self.mc(features)[0]


def build_model(
    cfg: DLRMConfig,
    table_sizes: list[int] | None = None,
    feature_names: list[str] | None = None,
    zch: ZchSpec | None = None,
    num_dense: int = NUM_DENSE,
) -> DLRMTrain:
    """DLRMTrain over a meta-device EmbeddingBagCollection, tables' optimiser fused into backward.

    table_sizes (one per C1..C26) replaces the table set's sizes, e.g. for data converted into other
    sizes and feature_names the C1..C26 feature names (data converted with other column names); the
    dense MLPs are initialised from the current torch seed. zch: the tables behind TorchRec's
    managed-collision remap (`--zch`, tpurec.dlrm.zch), one slot per row. Data of another shape
    (a column mapping with num_dense dense and any number of sparse columns) gets a model of its shape:
    the table set's first tables, and beyond its count tables ``t_<feature>`` of its last table's dim.
    """
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = embedding_bag_configs(get_table_set(cfg.table_set))
    sizes = table_sizes or [c.num_embeddings for c in configs]
    names = feature_names or [c.feature_names[0] for c in configs]
    for f in names[len(configs) :]:  # more features than the table set has tables
        last = configs[-1]
        configs.append(
            EmbeddingBagConfig(
                name=f"t_{f}",
                embedding_dim=last.embedding_dim,
                num_embeddings=last.num_embeddings,
                feature_names=[f],
                pooling=last.pooling,
            )
        )
    configs = [
        EmbeddingBagConfig(
            name=c.name,
            embedding_dim=cfg.embedding_dim or c.embedding_dim,
            num_embeddings=int(n),
            feature_names=[f],
            pooling=c.pooling,
        )
        for c, n, f in zip(configs, sizes, names)
    ]
    ebc: torch.nn.Module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    if zch is not None:
        from tpurec.dlrm.zch import managed_collision_ebc

        ebc = ZchEmbeddingBags(managed_collision_ebc(ebc, zch))
    common: dict[str, Any] = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=list(cfg.dense_arch),
        over_arch_layer_sizes=list(cfg.over_arch),
        dense_device=torch.device("cpu"),
    )
    dlrm: DLRM  # DLRM_DCN is one
    if cfg.interaction == "dcn":
        dlrm = DLRM_DCN(dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **common)
    else:
        dlrm = DLRM(**common)
    model = DLRMTrain(dlrm)
    cls, kwargs = table_optimizer(cfg)
    apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), kwargs)
    return model


def table_optimizer(cfg: DLRMConfig) -> tuple[type, dict]:
    """(optimizer class, kwargs) of the tables' optimizer fused into backward: --embedding-optimizer,
    --embedding-lr, and FBGEMM's weight decay as TorchRec's sharder passes it on."""
    cls, kwargs = _optimizer(cfg.embedding_optimizer, cfg.embedding_lr, cfg.eps)
    if cfg.embedding_weight_decay:
        kwargs |= {"weight_decay": cfg.embedding_weight_decay, "weight_decay_mode": cfg.embedding_weight_decay_mode}
    return cls, kwargs


def planner_constraints(cfg: DLRMConfig, device: DeviceKind, table_names: list[str]) -> dict[str, ParameterConstraints]:
    """ParameterConstraints for the planner: the table set's pooling factors, and on CPU the
    sharding types above."""
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.planner.kernel_choice import CPU_TRAINING_SHARDING_TYPES
    from tpurec.planner.planners import pooling_constraints

    specs = get_table_set(cfg.table_set).tables
    base = (
        {n: ParameterConstraints(sharding_types=list(CPU_TRAINING_SHARDING_TYPES)) for n in table_names}
        if device == DeviceKind.CPU
        else None
    )
    pooling = [t.pooling_factor for t in specs] if cfg.multi_hot_sizes is None else list(cfg.multi_hot_sizes)
    return pooling_constraints({t.name: float(p) for t, p in zip(specs, pooling)}, base=base)


def shard(
    model: torch.nn.Module,
    cfg: DLRMConfig,
    device: DeviceKind,
    *,
    plan: ShardingPlan | None = None,
    stock: bool = False,
    id_limits: str | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
    fixed_limits: bool | None = None,
    host_tier: str | None = None,
) -> DistributedModelParallel:
    """tpurec.DistributedModelParallel (tpurec planner and SparseCore kernel), or with stock=True,
    torchrec's own DMP with the FBGEMM `fused` kernel (for the benchmark). id_limits: the `--limits`
    file, read by DMP (only it knows the layout the file must match) into KernelSettings.id_limits.
    constraints: a `--model-module` model's own, {} for none (None: the built-in DLRM's, planner_constraints).
    fixed_limits: DMP's (every buffer shape fixed; EmbeddingCollections on their fixed-shape outputs).
    host_tier: DMP's ("auto": tables that do not fit the TPU's HBM planned onto the host tier)."""
    if stock:
        from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP

        return TorchrecDMP(model, device=torch.device("cpu"), plan=plan)
    from tpurec.sharding.dmp import DistributedModelParallel

    if constraints is None and plan is None:  # the built-in DLRM's: its table set's pooling, CPU's types
        dlrm: Any = model  # DLRMTrain: build_model's
        names = [c.name for c in dlrm.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
        constraints = planner_constraints(cfg, device, names)
    dev = torch.device("cpu") if device == DeviceKind.CPU else device
    return DistributedModelParallel(
        model,
        device=dev,
        plan=plan,
        batch_size=cfg.batch_size,
        constraints=constraints or None,
        id_limits=id_limits,
        fixed_limits=fixed_limits,
        host_tier=host_tier,
    )


def build_optimizer(dmp: DistributedModelParallel, cfg: DLRMConfig) -> CombinedOptimizer:
    """CombinedOptimizer of the fused table optimiser and the dense one (MLPs, keyed by name)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    cls, kwargs = _optimizer(cfg.dense_optimizer, cfg.dense_lr, cfg.eps)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: cls(params, **dict(kwargs))
    )
    return CombinedOptimizer([dmp.fused_optimizer, dense])


class LRSchedule:
    """Linear warm-up, constant, then polynomial (power 2) decay to 0 (the DLRM/MLPerf policy).

    Sets every param group's lr to base_lr * factor(step) before the step; the step's zero_grad()
    hands it to the fused table update (the compiled and pipelined steps read it when the update
    runs), so one object schedules both sides.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, decay_start: int, decay_steps: int) -> None:
        self.optimizer = optimizer
        self.warmup, self.decay_start, self.decay_steps = warmup_steps, decay_start, decay_steps
        self.base = [g["lr"] for g in optimizer.param_groups]

    @property
    def active(self) -> bool:
        return bool(self.warmup or self.decay_steps)

    def factor(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay_steps and step >= self.decay_start:
            left = max(0.0, 1.0 - (step - self.decay_start) / self.decay_steps)
            return left**2
        return 1.0

    def set_step(self, step: int) -> None:
        """The lr for the update of step `step` (0-based), a pure function of it (resume-safe)."""
        if not self.active:
            return
        f = self.factor(step)
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * f
