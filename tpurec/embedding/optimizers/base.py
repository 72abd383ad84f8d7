"""`OptimizerSpec`: everything tpurec needs to know about one fused optimizer, in one class.

A spec is a frozen dataclass of the optimizer's hyper-parameters. Its class says the rest: the name
tpurec uses for it (CLI choices, DLRM configs, the planner), the torch/TorchRec optimizer class it
stands for and which of its kwargs the fused update implements, FBGEMM's `EmbOptimType` (what
TorchRec's sharder puts in fused params), its state (TorchRec's names, shapes, bytes per row,
initial values), the param-group entries a `FusedOptimizer` exposes, whether it counts steps, and
`apply_update`, which calls its fused update op on one stack, and `direct_update`, its update loop in
the direct CPU step (tpurec/embedding/direct.py).

Subclasses register themselves when their module is imported (`__init_subclass__`); the registry
(`tpurec.embedding.optimizers.registry`) imports every module of this package, so adding an
optimizer means adding one module. Nothing else in tpurec branches on an optimizer's name.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Sequence

import numpy as np
import torch

from tpurec.embedding.optimizers.defaults import fused_lr
from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from tpurec.embedding.preprocess import SparseCoreInput

# name -> spec class, filled by OptimizerSpec.__init_subclass__ as spec modules are imported.
_REGISTERED: dict[str, type[OptimizerSpec]] = {}

# One stack's batch as the direct CPU step's update loops take it (direct_kernels.update_*, after the
# sort): keys, key bits, the tables' key segments, gains, bags, the activations' gradient, the table.
DirectHead = tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

# Torch optimizer kwargs that change nothing about the update's math; accepted and ignored.
_HARMLESS_TORCH_KWARGS = ("foreach", "differentiable", "capturable", "fused")


@dataclass(frozen=True)
class OptimizerSpec(abc.ABC):
    """One fused optimizer's hyper-parameters; the class attributes describe the optimizer."""

    lr: float = 0.01  # each spec's is its torch optimizer's default (tests/embedding/test_lr_defaults.py)
    # FBGEMM's weight decay (`weight_decay.py`): the mode is None when no decay applies, else the one
    # tpurec applies ("L2" or "DECOUPLE"); any FBGEMM mode name or `WeightDecayMode` may be given.
    weight_decay: float = field(default=0.0, kw_only=True)
    weight_decay_mode: Any = field(default=None, kw_only=True)

    # tpurec's name: the module's name, the CLI choice, the planner's and DLRM config's value.
    name: ClassVar[str]
    # Dotted path of the torch/TorchRec optimizer class users pass to apply_optimizer_in_backward
    # (resolved lazily: TorchRec's classes cost an import).
    torch_optimizer_path: ClassVar[str]
    # FBGEMM EmbOptimType member TorchRec's sharder puts under fused_params["optimizer"] (None when
    # FBGEMM has none), and other spellings of it the planner may meet in a sharder's fused params.
    fbgemm_optim: ClassVar[str | None] = None
    fbgemm_aliases: ClassVar[tuple[str, ...]] = ()
    # TorchRec's state names ("<table>.<state>" in a FusedOptimizer), in the order apply_update takes them.
    state_names: ClassVar[tuple[str, ...]] = ()
    # Torch kwargs the fused update does not implement: refused unless None/0/False.
    refused_torch_kwargs: ClassVar[tuple[str, ...]] = ()
    # Whether the update depends on the step count (bias correction): then the FusedOptimizer
    # checkpoints "<table>.step" with the state.
    keeps_step_count: ClassVar[bool] = False
    # FBGEMM weight_decay_mode name -> the decay tpurec applies for it ("L2" or "DECOUPLE"), as
    # FBGEMM's kernel for this optimizer does; a mode missing here is refused by name when
    # weight_decay is set. weight_decay_note: why FBGEMM's other modes are refused.
    weight_decay_modes: ClassVar[Mapping[str, str]] = {}
    weight_decay_note: ClassVar[str] = ""

    def __post_init__(self) -> None:
        """Hyper-parameters out of their domain are refused, never clamped (a NaN or negative lr would
        train silently to garbage); so is a weight decay FBGEMM's kernel would not apply."""
        from tpurec.embedding.optimizers import weight_decay

        for f in fields(self):
            if f.name != "weight_decay_mode":
                check_hyperparameter(getattr(self, "name", type(self).__name__), f.name, getattr(self, f.name))
        mode = weight_decay.resolve(type(self), self.weight_decay, self.weight_decay_mode)
        object.__setattr__(self, "weight_decay_mode", mode)
        if mode is None:  # no decay: one spec whatever mode was named with weight_decay 0
            object.__setattr__(self, "weight_decay", 0.0)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None:
            return  # an intermediate base, not an optimizer
        other = _REGISTERED.get(name)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(f"optimizer name {name!r} is taken by {other.__module__}.{other.__qualname__}")
        _REGISTERED[name] = cls

    # -- torch / TorchRec side -----------------------------------------------------------------
    @classmethod
    def torch_optimizer(cls) -> type:
        module, _, attr = cls.torch_optimizer_path.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    @classmethod
    def torch_class_name(cls) -> str:
        return cls.torch_optimizer_path.rpartition(".")[2]

    @classmethod
    def from_torch_kwargs(
        cls, kwargs: Mapping[str, Any] | None = None, optimizer_name: str | None = None
    ) -> OptimizerSpec:
        """The spec of `torch_optimizer()(params, **kwargs)`; refuses what the fused update lacks."""
        kwargs = dict(kwargs or {})
        name = optimizer_name or cls.torch_class_name()
        decay = {k: kwargs.pop(k) for k in ("weight_decay", "weight_decay_mode") if kwargs.get(k) is not None}
        for key in cls.refused_torch_kwargs:
            if kwargs.get(key) not in (None, 0, 0.0, False):
                raise UserError(f"{name}: {key}={kwargs[key]!r} is not supported by the fused SparseCore update")
            kwargs.pop(key, None)
        spec = cls._take_torch_kwargs(kwargs).with_weight_decay(decay)
        for harmless in _HARMLESS_TORCH_KWARGS:
            kwargs.pop(harmless, None)
        if kwargs:
            raise UserError(f"{name}: unsupported arguments for the fused SparseCore update: {sorted(kwargs)}")
        return spec

    @classmethod
    @abc.abstractmethod
    def _take_torch_kwargs(cls, kwargs: dict) -> OptimizerSpec:
        """Pop this optimizer's kwargs (with torch's defaults) and build the spec."""

    @abc.abstractmethod
    def torch_kwargs(self) -> dict:
        """The kwargs that rebuild this spec through `from_torch_kwargs` (a fresh dict)."""

    def with_weight_decay(self, options: Mapping[str, Any]) -> OptimizerSpec:
        """This spec with `weight_decay` / `weight_decay_mode` from `options` (torch kwargs or fused
        params), refused by name when FBGEMM's kernel would not apply them."""
        wd, mode = options.get("weight_decay"), options.get("weight_decay_mode")
        if wd is None and mode is None:
            return self
        return replace(self, weight_decay=float(wd or 0.0), weight_decay_mode=mode)

    def weight_decay_kwargs(self) -> dict:
        """The weight decay as kwargs TorchRec's sharder passes on to FBGEMM (empty without one):
        the mode only where FBGEMM needs it named (row-wise Adagrad; Adam decouples in mode NONE)."""
        if self.weight_decay_mode is None:
            return {}
        from tpurec.embedding.optimizers import weight_decay

        out: dict = {"weight_decay": self.weight_decay}
        if self.weight_decay_modes.get("NONE") != self.weight_decay_mode:
            out["weight_decay_mode"] = weight_decay.fbgemm_mode(self.weight_decay_mode)
        return out

    def to_torch(self) -> tuple[type, dict]:
        """(optimizer class, kwargs) for apply_optimizer_in_backward or a dense optimizer."""
        return self.torch_optimizer(), self.torch_kwargs()

    @classmethod
    def from_hyperparameters(cls, **values: float) -> OptimizerSpec:
        """The spec from generic settings (a config's lr and eps); ones it has no field for are ignored."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in values.items() if k in own})

    # -- FBGEMM / TorchRec fused params --------------------------------------------------------
    @classmethod
    def fbgemm_names(cls) -> tuple[str, ...]:
        """Every spelling of this optimizer in fused params: the EmbOptimType value and aliases."""
        if cls.fbgemm_optim is None:
            return cls.fbgemm_aliases
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        return (getattr(EmbOptimType, cls.fbgemm_optim).value, *cls.fbgemm_aliases)

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> OptimizerSpec:
        """The spec from the per-table fused params TorchRec's sharder builds (FBGEMM's vocabulary)."""
        return cls(lr=fused_lr(fused_params))

    @classmethod
    def default_lr(cls) -> float:
        """The lr a spec built from torch kwargs without one gets: its torch optimizer's default."""
        default = cls.__dataclass_fields__["lr"].default
        assert isinstance(default, float), default  # every spec's lr field has one
        return default

    # -- state ---------------------------------------------------------------------------------
    @classmethod
    def state_shape(cls, name: str, rows: int, dim: int) -> tuple[int, ...]:
        """Shape of state `name` for `rows` rows of width `dim` (element-wise by default)."""
        return (rows, dim)

    @classmethod
    def state_bytes_per_row(cls, dim: int) -> int:
        """f32 state bytes per table row of width `dim` (what the planner and memory checks add)."""
        total = 0
        for s in cls.state_names:
            n = 1
            for size in cls.state_shape(s, 1, dim):
                n *= size
            total += n
        return 4 * total

    @classmethod
    def state_bytes(cls, rows: int, dim: int) -> int:
        return rows * cls.state_bytes_per_row(dim)

    def initial_value(self, state: str) -> float:
        return 0.0

    def param_group_entries(self) -> dict:
        """Hyper-parameters a FusedOptimizer's param group shows besides "params" and "lr"."""
        return {}

    # -- the fused update ----------------------------------------------------------------------
    @abc.abstractmethod
    def apply_update(
        self,
        csr: SparseCoreInput,
        table: torch.Tensor,
        states: Sequence[torch.Tensor],
        grad: torch.Tensor,
        lr: float,
        step: int,
        computation_name: str = "tpurec",
        dim: int | None = None,
    ) -> None:
        """Run this optimizer's fused backward op on one stack, in place.

        `states` follow `state_names`; `step` is the 1-based count including this update. The op
        dispatches on the tensors' device: the CPU reference, or TorchTPU's op on a TPU.
        `computation_name` must be unique per stack and stable across steps: TorchTPU reuses a
        function by name inside one program, so two stacks sharing a name would collide.
        `dim` is the tables' embedding dim when the table is stored wider (padded to 8 columns whose
        gradients are zero); None means the table's width.
        """

    def update_rows(
        self,
        table: torch.Tensor,
        states: Sequence[torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        step: int,
        dim: int | None = None,
    ) -> None:
        """The CPU reference's update of given rows (unique physical rows, their summed gradients):
        what weight decay runs on CPU, where rows and gradients are at hand (kernel.apply_update).
        Only optimizers with weight decay modes need it."""
        raise NotImplementedError(f"{self.name}: no update of given rows (it takes no weight decay)")

    # -- the direct CPU step (tpurec/embedding/direct.py) ----------------------------------------
    # The spec fields `direct_update` implements; any other must be off (0, False or None) for a kernel
    # to take the direct step. None: the optimizer has none (its kernels take the layout path).
    direct_fields: ClassVar[frozenset[str] | None] = None

    def direct_update(self, head: DirectHead, states: Sequence[np.ndarray], lr: float, step: int) -> None:
        """The direct CPU step's update of one stack, in place: `head` is the batch's sorted keys and
        gradients and the table as `direct_kernels.update_sgd` takes them, `states` the stack's state
        arrays in `state_names` order, `step` the 1-based count including this update."""
        raise NotImplementedError(f"{self.name}: no direct CPU step (direct_fields is None)")

    def direct_decay(self, lr: float) -> tuple[np.float32, np.float32]:
        """Weight decay of the touched rows in the direct step (`weight_decay.py`): L2's coefficient, and
        the decoupled scale 1 - lr * wd rounded to float32 as the layout path's factor is; (0, 1) for none."""
        mode, wd, f32 = self.weight_decay_mode, self.weight_decay, np.float32
        return f32(wd if mode == "L2" else 0.0), f32(1.0 - lr * wd if mode == "DECOUPLE" else 1.0)

    @classmethod
    def tpu_kernels(cls) -> dict[Any, Callable]:
        """{tpurec custom op: TorchTPU call} that `tpurec.embedding.tpu.register` installs on a TPU host."""
        return {}

    def device_scalars(self, lr: float, step: int, width: int, dim: int) -> dict[str, float]:
        """The values this optimizer's TPU kernels take as device tensors (`tpu_scalar`), by name, for
        an update at `lr` that is step `step` (1-based) of a stack stored `width` wide with rows `dim`
        wide: a compiled step's feed holds them (step_scalars.py). Always in the same order."""
        out = {"lr": lr}
        if self.weight_decay_mode == "DECOUPLE":  # weight_decay.py's factor (of the group's lr)
            out["decay_factor"] = 1.0 - lr * self.weight_decay
        return out


def check_hyperparameter(optimizer: str, name: str, value: float) -> None:
    """One-line UserError unless `value` is in the domain of hyper-parameter `name`: finite; lr >= 0;
    eps >= 0; betas in [0, 1) (torch's own domains)."""
    v = float(value)
    problem = None
    if not math.isfinite(v):
        problem = "must be a finite number"
    elif name == "lr" and v < 0:
        problem = "must be >= 0"
    elif name.startswith("eps") and v < 0:
        problem = "must be >= 0"  # as torch's optimizers: 0 is allowed
    elif name == "weight_decay" and v < 0:
        problem = "must be >= 0"
    elif name.startswith("beta") and not 0 <= v < 1:
        problem = "must be in [0, 1)"
    if problem:
        raise UserError(f"{optimizer}: {name}={value!r} {problem}")


@torch.no_grad()
def add_to_rows(table: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, round_step: bool = False) -> None:
    """table[rows] += step (a float32 step; `rows` unique), in place. For a FP16/BF16 table this rounds
    (to nearest even) as FBGEMM's CPU TBE does for FP16 weights, whose `stochastic_rounding` flag is
    unused on CPU; its kernels round in one of two ways, and so do we:

    * round_step=False: w = round(float32(w) + step), once (its row-wise Adagrad assigns
      `w = w - g * multiplier`, computed in float32);
    * round_step=True: w = round(w + round(step)) (its SGD and Adagrad write `w -= step` on a Half,
      which converts the float32 step to Half first).

    For float32 tables both are w + step."""
    if table.dtype == torch.float32 and _plain_cpu(table, rows, step):
        from tpurec.embedding import csr_kernels  # numba, loaded on first use

        csr_kernels.add_rows(table.numpy(), rows.to(torch.int64).numpy(), step.to(torch.float32).contiguous().numpy())
    elif table.dtype == torch.float32 or round_step:
        table.index_add_(0, rows, step.to(table.dtype))
    else:
        table.index_copy_(0, rows, table.index_select(0, rows).to(torch.float32).add_(step).to(table.dtype))


def _plain_cpu(table: torch.Tensor, *others: torch.Tensor) -> bool:
    """Real, contiguous CPU tensors outside tracing: what the compiled row loop may write to in place."""
    return (
        table.device.type == DeviceKind.CPU
        and table.is_contiguous()
        and all(type(t) is torch.Tensor and t.device.type == DeviceKind.CPU for t in (table, *others))
        and not torch.compiler.is_compiling()
    )


def op_tail(csr: SparseCoreInput) -> tuple[int, int, int, int, int]:
    """The trailing int arguments every SparseCore op takes."""
    return (
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
        csr.max_ids_per_partition,
        csr.max_unique_ids_per_partition,
    )


def op_head(
    csr: SparseCoreInput, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The leading tensor arguments every SparseCore op takes."""
    return (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, table)


# While `record_tpu_calls()` is active: (op name, compile key) of every TorchTPU op call.
_RECORDED: list | None = None


def _compile_key(args: tuple[Any, ...]) -> tuple:
    # TorchTPU keys a compiled program on tensor shapes/dtypes and every non-tensor argument
    # (float hyper-parameters, id limits, names); tensor values (learning rates) are runtime inputs.
    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else a for a in args)


class _RecordingOps:
    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(self._ops, name)

        def call(*args: Any) -> Any:
            if _RECORDED is not None:
                _RECORDED.append((name, _compile_key(args)))
            return op(*args)

        return call


@contextlib.contextmanager
def record_tpu_calls() -> Iterator[list[tuple[Any, ...]]]:
    """Record the compile key of every TorchTPU op tpurec calls inside the block: the number of
    distinct keys is the number of programs TorchTPU compiles (`tpurec selftest --device tpu`)."""
    global _RECORDED
    _RECORDED = []
    try:
        yield _RECORDED
    finally:
        _RECORDED = None


def tpu_ops() -> Any:
    """TorchTPU's op namespace; only called on a TPU host, where torch_tpu registered it."""
    return recorded(torch.ops.tpu)


def recorded(namespace: Any) -> Any:
    """`namespace` (ops as attributes), its calls recorded while `record_tpu_calls()` is active."""
    return namespace if _RECORDED is None else _RecordingOps(namespace)


def registered() -> dict[str, type[OptimizerSpec]]:
    """The spec classes imported so far, by name (the registry imports them all first)."""
    return dict(_REGISTERED)
