"""Adagrad, element-wise: `a += g*g; w -= lr * g / (sqrt(a) + eps)` on the rows in the batch.

Stands for `torch.optim.Adagrad` (no lr decay; no weight decay, as FBGEMM's EXACT_ADAGRAD has none). Owns the
`tpurec::sparse_dense_matmul_grad_with_adagrad` op, which also serves row-wise Adagrad
(`rowwise_adagrad.py`): a 2-D accumulator updates element-wise, a 1-D one row-wise, as TorchTPU's op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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
    table: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float, eps: float
) -> None:
    """Element-wise (2-D accumulator) or row-wise (1-D accumulator) Adagrad."""
    if accumulator.dim() == 1:
        # mean(g*g) per row as a squared norm: one pass, no [rows, dim] temporary
        acc = accumulator.index_select(0, rows) + torch.linalg.vector_norm(grad, dim=1).square_() / grad.shape[1]
        accumulator.index_copy_(0, rows, acc)
        step = grad.mul_((-lr / (acc.sqrt() + eps)).unsqueeze(1))
    else:
        acc = accumulator.index_select(0, rows).addcmul_(grad, grad)
        accumulator.index_copy_(0, rows, acc)
        step = grad.mul_(-lr).div_(acc.sqrt_().add_(eps))
    # FBGEMM's FP16 rounding: element-wise `w -= step` on a Half, row-wise `w = w - step` in float32
    add_to_rows(table, rows, step, round_step=accumulator.dim() != 1)


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_adagrad",
    mutates_args=("embedding_table", "accumulator"),
    device_types="cpu",
)
def op(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    accumulator: Tensor,
    activations_grad: Tensor,
    learning_rate: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adagrad",
) -> None:
    """Element-wise Adagrad for a 2-D accumulator, row-wise Adagrad for a 1-D one."""
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
    reference_update(embedding_table, accumulator, rows, g, learning_rate, epsilon)


op.register_fake(lambda *args, **kwargs: None)  # in place: nothing to compute under fake tensors


def tpu_update(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    embedding_table: torch.Tensor,
    accumulator: torch.Tensor,
    activations_grad: torch.Tensor,
    learning_rate: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adagrad",
) -> None:
    """The op's TPU kernel: TorchTPU's op returns new table and accumulator; copy them back."""
    new_table, new_acc = tpu_ops()._sparse_dense_matmul_grad_with_adagrad(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        accumulator,
        activations_grad.contiguous(),
        tpu_scalar(learning_rate, embedding_table, "lr"),
        epsilon,
        device_batch_size,
        max_ids_per_partition,
        max_unique_ids_per_partition,
        computation_name,
    )
    embedding_table.copy_(new_table)
    accumulator.copy_(new_acc)


# FBGEMM's default eps for what TorchRec's fused params leave out (fbgemm_gpu
# split_table_batched_embeddings_ops_training.SplitTableBatchedEmbeddingBagsCodegen.__init__).
FBGEMM_EPS = 1.0e-8


@dataclass(frozen=True)
class AdagradSpec(OptimizerSpec):
    lr: float = 1e-2
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    name = "adagrad"
    torch_optimizer_path = "torch.optim.Adagrad"
    fbgemm_optim = "EXACT_ADAGRAD"
    fbgemm_aliases: ClassVar[tuple[str, ...]] = ("adagrad",)
    state_names: ClassVar[tuple[str, ...]] = ("momentum1",)  # TorchRec's name for Adagrad's sum
    refused_torch_kwargs = ("lr_decay", "maximize")  # weight_decay: FBGEMM's modes, weight_decay.py
    direct_fields = frozenset({"lr", "eps", "initial_accumulator_value"})

    @classmethod
    def _take_torch_kwargs(cls, kwargs: dict) -> AdagradSpec:
        return cls(
            lr=float(kwargs.pop("lr", cls.default_lr())),
            eps=float(kwargs.pop("eps", 1e-10)),
            initial_accumulator_value=float(kwargs.pop("initial_accumulator_value", 0.0)),
        )

    def torch_kwargs(self) -> dict:
        kwargs = {"lr": self.lr, "eps": self.eps}
        if self.initial_accumulator_value:
            kwargs["initial_accumulator_value"] = self.initial_accumulator_value
        return kwargs | self.weight_decay_kwargs()

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> OptimizerSpec:
        # What TorchRec's fused kernel does with what it was not given: FBGEMM's defaults
        # (SplitTableBatchedEmbeddingBagsCodegen: learning_rate 0.01, eps 1.0e-8). torch.optim.Adagrad's
        # 1e-10 (the torch-kwargs route above) is what an unsharded module's in-backward optimizer uses.
        return cls(
            lr=fused_lr(fused_params),
            eps=float(fused_params.get("eps", FBGEMM_EPS)),
            initial_accumulator_value=float(fused_params.get("initial_accumulator_value", 0.0)),
        )

    def initial_value(self, state: str) -> float:
        return self.initial_accumulator_value

    def param_group_entries(self) -> dict:
        return {"eps": self.eps}

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
        (accumulator,) = states
        torch.ops.tpurec.sparse_dense_matmul_grad_with_adagrad(
            *op_head(csr, table), accumulator, grad, lr, self.eps, *op_tail(csr), computation_name
        )

    def direct_update(self, head: DirectHead, states: Sequence[np.ndarray], lr: float, step: int) -> None:
        from tpurec.embedding import direct_kernels as dk

        f32 = np.float32
        dk.update_adagrad(*head, states[0], f32(-lr), np.float64(f32(self.eps)))  # FBGEMM adds eps in double

    @classmethod
    def tpu_kernels(cls) -> dict[Any, Callable]:
        return {op: tpu_update}

    def device_scalars(self, lr: float, step: int, width: int, dim: int) -> dict[str, float]:
        return {**super().device_scalars(lr, step, width, dim), "eps": self.eps}
