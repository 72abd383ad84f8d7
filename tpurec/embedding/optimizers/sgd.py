"""SGD: `w -= lr * g` on the rows in the batch; no state.

Stands for `torch.optim.SGD` without momentum, dampening, weight decay or Nesterov, and FBGEMM's
EXACT_SGD (which has no weight decay either: refused, `weight_decay.py`). Owns the
`tpurec::sparse_dense_matmul_grad_with_sgd` op: its CPU reference and its TorchTPU call.
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
def reference_update(table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    add_to_rows(table, rows, grad.mul_(-lr), round_step=True)  # FBGEMM's `w -= lr * g` on FP16 weights


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_sgd", mutates_args=("embedding_table",), device_types="cpu"
)
def op(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    activations_grad: Tensor,
    learning_rate: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_sgd",
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
    reference_update(embedding_table, rows, g, learning_rate)


op.register_fake(lambda *args, **kwargs: None)  # in place: nothing to compute under fake tensors


def tpu_update(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    embedding_table: torch.Tensor,
    activations_grad: torch.Tensor,
    learning_rate: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_sgd",
) -> None:
    """The op's TPU kernel: TorchTPU's op returns the new table; copy it back in place."""
    new_table = tpu_ops()._sparse_dense_matmul_grad_with_sgd(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        activations_grad.contiguous(),
        tpu_scalar(learning_rate, embedding_table, "lr"),
        device_batch_size,
        max_ids_per_partition,
        max_unique_ids_per_partition,
        computation_name,
    )
    embedding_table.copy_(new_table)


@dataclass(frozen=True)
class SGDSpec(OptimizerSpec):
    lr: float = 1e-3

    name = "sgd"
    torch_optimizer_path = "torch.optim.SGD"
    fbgemm_optim = "EXACT_SGD"
    fbgemm_aliases = ("sgd",)
    refused_torch_kwargs = ("momentum", "dampening", "nesterov", "maximize")  # weight_decay: weight_decay.py
    direct_fields = frozenset({"lr"})

    @classmethod
    def _take_torch_kwargs(cls, kwargs: dict) -> SGDSpec:
        return cls(lr=float(kwargs.pop("lr", cls.default_lr())))

    def torch_kwargs(self) -> dict:
        return {"lr": self.lr}

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> SGDSpec:
        return cls(lr=fused_lr(fused_params))

    def apply_update(
        self,
        csr: SparseCoreInput,
        table: torch.Tensor,
        states: Sequence[torch.Tensor],
        grad: torch.Tensor,
        lr: float,
        step: int,
        computation_name: str = "tpurec_sgd",
        dim: int | None = None,
    ) -> None:
        torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(
            *op_head(csr, table), grad, lr, *op_tail(csr), computation_name
        )

    def direct_update(self, head: DirectHead, states: Sequence[np.ndarray], lr: float, step: int) -> None:
        from tpurec.embedding import direct_kernels as dk

        dk.update_sgd(*head, np.float32(-lr))

    @classmethod
    def tpu_kernels(cls) -> dict[Any, Callable]:
        return {op: tpu_update}
