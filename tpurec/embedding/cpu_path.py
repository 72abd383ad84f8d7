"""Two facts both CPU step paths need (kernel.py's layout path and direct.py's direct step), kept
apart from both so that neither imports the other."""

from __future__ import annotations

import torch

from tpurec.embedding import ops
from tpurec.runtime.device import DeviceKind


def grad_trigger() -> torch.Tensor:
    """An empty tensor that requires grad: makes autograd call our backward even though the table
    itself never requires grad (its update happens inside backward, fused)."""
    return torch.empty(0, requires_grad=True)


def writes_final_layout(weight: torch.Tensor) -> bool:
    """Whether stack lookups go straight to the CPU reference, which writes [batch, features * dim]
    itself (and reads its gradient in place): real CPU tensors in eager mode. Elsewhere (a TPU, fake
    or meta tensors, tracing) the op runs, [features * padded batch, width], reshaped by `lookup`;
    on CPU that reshape was a full copy of the activations forward and again backward."""
    return (
        weight.device.type == DeviceKind.CPU
        and type(weight) is torch.Tensor
        and not torch.compiler.is_compiling()
        and ops.reference_is_cpu_kernel()
    )
