"""The torchrec `FusedOptimizer` view of embedding kernels' optimizer (kernel_protocol.py): one base, two uses.

Updates happen inside backward, so step() and zero_grad() only hand the param group's learning
rate to the kernels, when stock TorchRec's fused optimizer hands it to FBGEMM. What this object
gives is what TorchRec users expect of a fused optimizer: `param_groups` with a learning rate that LR
schedulers may change (an eager forward's update uses the lr handed over last, as stock's does; the
compiled and pipelined steps read it at their update), and a keyed `state_dict()` /
`load_state_dict()` for checkpoints. Kernels keep tables and state in natural row order
(`tpurec.embedding.layout`), so the state handed out is VIEWS of the live storage: an in-place
write (torch.distributed.checkpoint's load, TorchRec's copy_state_dict) lands in the kernel, and
nothing is held twice. Only step counts (Adam's bias correction) live in plain ints inside the
kernel; they are mirrored into "<table>.step" scalars when the kernels moved, and a value written
into a scalar (in place, by DCP, or by `load_state_dict`) reaches the kernels before their next
update (a pre-update hook compares each scalar with the value last mirrored).

`KernelFusedOptimizer` holds that machinery: entries (kernel, table, state name, view), the param
group built from the optimizer spec, step counts. The standalone `SparseCoreFusedOptimizer` below
keys plain tensors by table; the sharded EBC's (`tpurec.sharding.sharded_optimizer`) wraps the same
views in ShardedTensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torchrec.optim.fused import FusedOptimizer

from tpurec.embedding.kernel_protocol import EmbeddingKernel
from tpurec.embedding.optimizers.base import OptimizerSpec


@dataclass
class KernelEntry:
    """One natural-order view the optimizer exposes and the kernel storage behind it."""

    kernel: EmbeddingKernel
    table: str  # the kernel's table name
    state: str | None  # an optimizer state name, or None for the table's weight
    tensor: torch.Tensor  # a view of the kernel's storage (a ShardedTensor's local shard under sharding)

    @property
    def copied(self) -> bool:
        """True when `tensor` is a copy, not a view: a table stored wider than its dim (padded for the
        SparseCore) read into a contiguous ShardedTensor shard. Copies refresh and write back."""
        return self.tensor.data_ptr() != self.read().data_ptr()

    def read(self) -> torch.Tensor:
        if self.state is None:
            return self.kernel.read_weight(self.table)
        return self.kernel.read_state(self.table, self.state)

    def write(self) -> None:
        # A view already holds what was loaded into it; a tensor that replaced it (load_state_dict
        # may assign) is copied in. Weights are restored through the module's state_dict instead.
        if self.state is not None:
            self.kernel.write_state(self.table, self.state, self.tensor)


@dataclass
class StepEntry:
    """A checkpointed "<table>.step" and the kernel tables whose step count it stands for."""

    tensor: torch.Tensor
    tables: list[tuple[EmbeddingKernel, str]]
    seen: float = 0.0  # the value last mirrored from (or written to) the kernels

    def adopt_if_written(self) -> None:
        """A value written into the scalar since it was last mirrored goes to the kernels."""
        value = float(self.tensor.item())
        if value != self.seen:
            for k, t in self.tables:
                k.set_step_count(t, int(value))
            self.seen = value


class KernelFusedOptimizer(FusedOptimizer):
    """A FusedOptimizer whose `state` holds views of kernel storage.

    Subclasses build params and state with `_track` (a view of a kernel table's weight or state) and
    `_step` (a step-count scalar, for specs that keep one), then call this __init__. TorchRec's
    CombinedOptimizer, which DMP and the sharded EBC wrap us in, builds its state_dict from the
    children's `.state` and never calls our state_dict(), so step scalars refresh on access, but only
    when the kernels moved since the last refresh: a state_dict handed to DCP shares our tensors, and
    refreshing between dcp.load and load_state_dict would overwrite what was loaded.
    """

    # Whether the param group shows the spec's hyper-parameters (eps, betas) besides lr.
    expose_hyperparameters: ClassVar[bool] = True
    # Whether the param group's lr starts rounded to float32, as a TorchRec DMP's fused optimizer
    # shows it (FBGEMM's `get_learning_rate()` reads its float32 learning-rate tensor back): a
    # scheduler multiplying that lr then sets the same values on both.
    float32_lr: ClassVar[bool] = False
    _ready = False

    def __init__(
        self, kernels: Sequence[EmbeddingKernel], spec: OptimizerSpec | None, params: dict, state: dict
    ) -> None:
        self._kernels = list(kernels)
        self._spec = spec
        lr = spec.lr if spec is not None else 0.0
        group = {"params": list(params.values()), "lr": float(np.float32(lr)) if self.float32_lr else lr}
        if spec is not None and self.expose_hyperparameters:
            group.update(spec.param_group_entries())
        super().__init__(params, state, [group])
        self._ready = True
        for k in self._kernels:  # kernels read the learning rate from here at every update
            k.lr_source = group
            k.latch_lr()
            k.pre_update_hooks.append(self._adopt_written_steps)

    # -- building ------------------------------------------------------------------------------
    def _track(self, kernel: EmbeddingKernel, table: str, state: str | None, tensor: torch.Tensor) -> torch.Tensor:
        """Register `tensor`, a view of kernel table `table`'s weight (state None) or state."""
        self.__dict__.setdefault("_entries", []).append(KernelEntry(kernel, table, state, tensor))
        return tensor

    def _step(self, tables: list[tuple[EmbeddingKernel, str]]) -> torch.Tensor:
        """A "<table>.step" scalar standing for the step counts of `tables` (kernel, table name)."""
        tensor = torch.tensor(0.0)
        self.__dict__.setdefault("_step_entries", []).append(StepEntry(tensor, list(tables)))
        return tensor

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> Any:
        if self._ready:
            version = self._kernels_version()
            if version != getattr(self, "_refreshed_at", None):
                self._refresh()
                self._refreshed_at = version
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value

    def _kernels_version(self) -> tuple:
        # Every update bumps a step count, so the counts tell whether the kernels moved.
        return tuple(k.step_count(t) for k in self._kernels for t in k.table_names)

    def _refresh(self) -> None:
        """Mirror the kernels' step counts into the step scalars, and their storage into any copies
        (tables and state are views otherwise)."""
        with torch.no_grad():
            for e in self.__dict__.get("_entries", []):
                if e.copied:
                    e.tensor.copy_(e.read())
            for s in self.__dict__.get("_step_entries", []):
                s.tensor.fill_(max((k.step_count(t) for k, t in s.tables), default=0))
                s.seen = float(s.tensor.item())

    def _adopt_written_steps(self) -> None:
        for s in self.__dict__.get("_step_entries", []):
            s.adopt_if_written()

    def _write_back(self) -> None:
        """Copy loaded step counts (and any state tensor that replaced a view) into the kernels."""
        for e in self.__dict__.get("_entries", []):
            e.write()
        for s in self.__dict__.get("_step_entries", []):
            for k, t in s.tables:
                k.set_step_count(t, int(s.tensor.item()))
            s.seen = float(s.tensor.item())

    def post_load_state_dict(self) -> None:
        self._write_back()
        self._refreshed_at = self._kernels_version()

    # Updates run inside backward: step() and zero_grad() only hand the group's lr to the kernels, as
    # stock's fused optimizer hands it to FBGEMM there (`set_learning_rate`); a forward's update uses
    # the lr latched last (`SparseCoreKernel.forward_lr`).
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # fused into backward: no closure value
        self._latch_lr()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._latch_lr()

    def _latch_lr(self) -> None:
        for k in self._kernels:
            k.latch_lr()


class SparseCoreFusedOptimizer(KernelFusedOptimizer):
    """The fused optimizer of one kernel, its state as plain natural-order tensors keyed by table."""

    def __init__(
        self,
        kernel: EmbeddingKernel,
        param_prefix: str = "embedding_bags.",
        key_of: Callable[[str], str] | None = None,
    ) -> None:
        """key_of(kernel table name) -> "<name>.weight": how params are keyed (default: the table name)."""
        key_of = key_of or (lambda name: f"{name}.weight")
        spec = kernel.optimizer
        params: dict[str, torch.Tensor] = {}
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for table in kernel.table_names:
            key = key_of(table)
            base = key[: -len(".weight")]
            snapshot = self._track(kernel, table, None, kernel.read_weight(table))
            params[param_prefix + key] = snapshot
            entry = {
                f"{base}.{s}": self._track(kernel, table, s, kernel.read_state(table, s)) for s in spec.state_names
            }
            if spec.keeps_step_count:
                entry[f"{base}.step"] = self._step([(kernel, table)])
            state[snapshot] = entry
        super().__init__([kernel], spec, params, state)
