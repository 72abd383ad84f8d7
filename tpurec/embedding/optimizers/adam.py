"""Adam, lazy: only the rows in the batch update, as on SparseCore and in FBGEMM's fused kernel.

  m = b1 m + (1-b1) g; v = b2 v + (1-b2) g*g; w -= alpha_t * m / (sqrt(v) + eps)
  with alpha_t = lr sqrt(1-b2^t) / (1-b1^t) and a CONSTANT eps

Why a constant eps: TorchTPU compiles float hyper-parameters (beta1, beta2, epsilon) into the program
and its cache key, so a per-step epsilon (torch.optim.Adam's exact form needs eps sqrt(1-b2^t) here)
would compile a new program every step. The bias correction goes through alpha_t, a runtime tensor.
This is Kingma & Ba's "epsilon hat" form (Adam paper, end of section 2; TensorFlow's Adam): it
equals torch.optim.Adam with eps replaced by eps / sqrt(1-b2^t), a larger epsilon in the first steps
(31.6x at t=1 with b2=0.999) that fades to eps; with eps=1e-8 the updates differ from torch's by a
relative ~1e-6 or less (docs/kernels.md).

Stands for `torch.optim.Adam` (no AMSGrad or maximize) and FBGEMM's ADAM, whose weight decay is
decoupled, AdamW-style, whatever the mode (`weight_decay.py`): so is tpurec's. The bias
correction needs the step count, so the kernel counts steps and checkpoints carry "<table>.step".
Owns the `tpurec::sparse_dense_matmul_grad_with_adam` op: CPU reference and TorchTPU call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from tpurec.embedding import ops
from tpurec.embedding.optimizers.base import OptimizerSpec, add_to_rows, op_head, op_tail, tpu_ops
from tpurec.embedding.optimizers.defaults import fused_lr
from tpurec.embedding.step_scalars import tpu_scalar

if TYPE_CHECKING:
    from tpurec.embedding.optimizers.base import DirectHead
    from tpurec.embedding.preprocess import SparseCoreInput


@torch.no_grad()
def reference_update(
    table: torch.Tensor,
    momentum: torch.Tensor,
    velocity: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    alpha_t: float,
    beta1: float,
    beta2: float,
    epsilon: float,
) -> None:
    m = momentum.index_select(0, rows).mul_(beta1).add_(grad, alpha=1 - beta1)
    v = velocity.index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    momentum.index_copy_(0, rows, m)
    velocity.index_copy_(0, rows, v)
    step = m.mul(alpha_t).div_(v.sqrt().add_(epsilon))
    add_to_rows(table, rows, step.neg_())


# The scalars the TensorCore kernel's Adam takes as device tensors, in its order (tpu_bridge.adam_update);
# TorchTPU's SparseCore op takes the first alone (`tpu_update`). 1 - beta in float64, rounded once.
DEVICE_SCALARS = ("alpha_t", "beta_1", "beta_2", "epsilon", "one_minus_beta_1", "one_minus_beta_2")


def alpha_t(lr: float, beta1: float, beta2: float, step: int) -> float:
    """The bias-corrected step size of step t (1-based): lr sqrt(1-b2^t) / (1-b1^t)."""
    return lr * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_adam",
    mutates_args=("embedding_table", "momentum", "velocity"),
    device_types="cpu",
)
def op(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    momentum: Tensor,
    velocity: Tensor,
    activations_grad: Tensor,
    alpha_t: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adam",
) -> None:
    rows, g = ops.row_gradients(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        activations_grad,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
    )
    reference_update(embedding_table, momentum, velocity, rows, g, alpha_t, beta_1, beta_2, epsilon)


op.register_fake(lambda *args, **kwargs: None)  # in place: nothing to compute under fake tensors


def tpu_update(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    embedding_table: torch.Tensor,
    momentum: torch.Tensor,
    velocity: torch.Tensor,
    activations_grad: torch.Tensor,
    alpha_t: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adam",
) -> None:
    """The op's TPU kernel: TorchTPU's op returns new table and moments; copy them back."""
    new_table, new_m, new_v = tpu_ops()._sparse_dense_matmul_grad_with_adam(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        momentum,
        velocity,
        activations_grad.contiguous(),
        tpu_scalar(alpha_t, embedding_table, "alpha_t"),
        beta_1,
        beta_2,
        epsilon,
        device_batch_size,
        max_ids_per_partition,
        max_unique_ids_per_partition,
        computation_name,
    )
    embedding_table.copy_(new_table)
    momentum.copy_(new_m)
    velocity.copy_(new_v)


@dataclass(frozen=True)
class AdamSpec(OptimizerSpec):
    lr: float = 1e-3
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    name = "adam"
    torch_optimizer_path = "torch.optim.Adam"
    fbgemm_optim = "ADAM"
    fbgemm_aliases = ()
    state_names = ("momentum1", "exp_avg_sq")  # TorchRec's and FBGEMM's names for m and v
    refused_torch_kwargs = ("amsgrad", "maximize")
    # FBGEMM's Adam decays decoupled (AdamW) in every mode; tpurec takes NONE and DECOUPLE (weight_decay.py).
    weight_decay_modes = {"NONE": "DECOUPLE", "DECOUPLE": "DECOUPLE"}
    weight_decay_note = "decays decoupled (AdamW: w -= lr * weight_decay * w) whatever the mode, not as named"
    keeps_step_count = True
    direct_fields = frozenset({"lr", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode"})

    @classmethod
    def _take_torch_kwargs(cls, kwargs: dict) -> AdamSpec:
        # torch.optim.Adam(decoupled_weight_decay=True) is AdamW, the decay tpurec applies (as FBGEMM's
        # Adam) either way: accepted as True or False, the decay always decoupled (docs/dmp.md).
        kwargs.pop("decoupled_weight_decay", None)
        b1, b2 = kwargs.pop("betas", (0.9, 0.999))
        return cls(
            lr=float(kwargs.pop("lr", cls.default_lr())),
            eps=float(kwargs.pop("eps", 1e-8)),
            beta1=float(b1),
            beta2=float(b2),
        )

    def torch_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"lr": self.lr, "eps": self.eps}
        if (self.beta1, self.beta2) != (0.9, 0.999):
            kwargs["betas"] = (self.beta1, self.beta2)
        return kwargs | self.weight_decay_kwargs()

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> OptimizerSpec:
        fp = fused_params
        betas = fp.get("betas", (fp.get("beta1", 0.9), fp.get("beta2", 0.999)))
        return cls(
            lr=fused_lr(fp),
            eps=float(fp.get("eps", 1e-8)),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
        )

    def param_group_entries(self) -> dict:
        return {"eps": self.eps, "betas": (self.beta1, self.beta2)}

    def device_scalars(self, lr: float, step: int, width: int, dim: int) -> dict[str, float]:
        b1, b2 = self.beta1, self.beta2
        values = (alpha_t(lr, b1, b2, step), b1, b2, self.eps, 1.0 - b1, 1.0 - b2)
        return {**super().device_scalars(lr, step, width, dim), **dict(zip(DEVICE_SCALARS, values))}

    def apply_update(
        self,
        csr: SparseCoreInput,
        table: torch.Tensor,
        states: Sequence[torch.Tensor],
        grad: torch.Tensor,
        lr: float,
        step: int,
        computation_name: str = "tpurec_adam",
        dim: int | None = None,
    ) -> None:
        momentum, velocity = states
        torch.ops.tpurec.sparse_dense_matmul_grad_with_adam(
            *op_head(csr, table),
            momentum,
            velocity,
            grad,
            alpha_t(lr, self.beta1, self.beta2, step),
            self.beta1,
            self.beta2,
            self.eps,
            *op_tail(csr),
            computation_name,
        )

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
        momentum, velocity = states
        a = alpha_t(lr, self.beta1, self.beta2, step)
        reference_update(table, momentum, velocity, rows, grad, a, self.beta1, self.beta2, self.eps)

    def direct_update(self, head: DirectHead, states: Sequence[np.ndarray], lr: float, step: int) -> None:
        from tpurec.embedding import direct_kernels as dk

        f32, (m, v), b1, b2 = np.float32, states, self.beta1, self.beta2
        a = alpha_t(lr, b1, b2, step)
        decay = self.direct_decay(lr)
        dk.update_adam(*head, m, v, f32(-a), f32(b1), f32(1 - b1), f32(b2), f32(1 - b2), f32(self.eps), *decay)

    @classmethod
    def tpu_kernels(cls) -> dict[Any, Callable]:
        return {op: tpu_update}
