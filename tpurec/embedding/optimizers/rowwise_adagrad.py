"""Row-wise Adagrad: one accumulator per row, `a += mean(g*g); w -= lr * g / (sqrt(a) + eps)`.

Stands for `torchrec.optim.RowWiseAdagrad` and FBGEMM's EXACT_ROWWISE_ADAGRAD, with its weight decay
modes L2 and DECOUPLE (given as `weight_decay_mode`, as FBGEMM takes them; `weight_decay.py`). Its update is the
Adagrad op of `adagrad.py` given a 1-D accumulator (as TorchTPU's op is), so this module only says
what differs: names, a state of one float per row, and TorchRec's row-wise checkpoint layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tpurec.embedding.optimizers.adagrad import AdagradSpec, reference_update

if TYPE_CHECKING:
    from tpurec.embedding.optimizers.base import DirectHead
    from tpurec.embedding.preprocess import SparseCoreInput


@dataclass(frozen=True)
class RowWiseAdagradSpec(AdagradSpec):
    name = "rowwise_adagrad"
    torch_optimizer_path = "torchrec.optim.RowWiseAdagrad"
    fbgemm_optim = "EXACT_ROWWISE_ADAGRAD"
    fbgemm_aliases = ("row_wise_adagrad", "rowwise_adagrad")
    refused_torch_kwargs = ("lr_decay", "maximize")
    # FBGEMM's row-wise Adagrad: L2 (gradient + wd * w) and decoupled (w *= 1 - lr * wd); NONE applies
    # none (weight_decay.py).
    weight_decay_modes = {"L2": "L2", "DECOUPLE": "DECOUPLE"}
    direct_fields = frozenset({"lr", "eps", "initial_accumulator_value", "weight_decay", "weight_decay_mode"})

    @classmethod
    def state_shape(cls, name: str, rows: int, dim: int) -> tuple[int, ...]:
        return (rows,)

    def apply_update(
        self,
        csr: SparseCoreInput,
        table: torch.Tensor,
        states: Sequence[torch.Tensor],
        grad: torch.Tensor,
        lr: float,
        step: int,
        computation_name: str = "tpurec_adagrad",
        dim: int | None = None,
    ) -> None:
        """The accumulator takes mean(g*g) over the row's width; for a table stored wider than its dim
        (zero-gradient padding columns), scale the gradient by s = sqrt(width/dim) and the learning
        rate by 1/s: then mean over the width of (s g)^2 is the mean of g^2 over dim, and
        (lr/s)(s g) = lr g, exactly FBGEMM's row-wise Adagrad at the table's own dim."""
        grad, lr = _at_width(grad, lr, table.shape[1], dim)
        super().apply_update(csr, table, states, grad, lr, step, computation_name)

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
        (accumulator,) = states
        grad, lr = _at_width(grad, lr, table.shape[1], dim)
        reference_update(table, accumulator, rows, grad, lr, self.eps)

    def device_scalars(self, lr: float, step: int, width: int, dim: int) -> dict[str, float]:
        out = super().device_scalars(lr, step, width, dim)
        return {**out, "lr": _at_width_lr(lr, width, dim)}  # the op's lr (apply_update); the decay's stays

    def direct_update(self, head: DirectHead, states: Sequence[np.ndarray], lr: float, step: int) -> None:
        from tpurec.embedding import direct_kernels as dk

        f32 = np.float32
        dk.update_rowwise_adagrad(*head, states[0], f32(-lr), f32(self.eps), *self.direct_decay(lr))


def _at_width(grad: torch.Tensor, lr: float, width: int, dim: int | None) -> tuple[torch.Tensor, float]:
    """(gradient, lr) for a table stored `width` wide whose rows are `dim` wide (apply_update says why)."""
    if dim is None or dim == width:
        return grad, lr
    return grad * (width / dim) ** 0.5, _at_width_lr(lr, width, dim)


def _at_width_lr(lr: float, width: int, dim: int | None) -> float:
    return lr if dim is None or dim == width else lr / (width / dim) ** 0.5
