"""torch.optim's single-tensor CPU steps (`torch.optim.sgd/adagrad/adam._single_tensor_*`, what the
eager trainer runs on CPU tensors) written so `torch.compile(fullgraph=True)` traces them, the lr a
float64 tensor input (float32 on a TPU, dense_update.py `scalars_on`): `UPDATE[kind](param, grad, state,
lr, hp)`, used by dense_update.py.

The same numbers as torch.optim, op for op (bit-equal: tests/sharding/test_dense_update.py): a
float64 scalar tensor rounded to float32 is the float32 a kernel makes of a Python float operand;
`param.addcdiv_(a, b, value=-s)` is `param.add_(a * -s / b)` (the kernel's own order: scalar * a,
/ b, + param); `param.add_(g, alpha=-lr)` is `aten.addcmul_(param, g, -lr)`. The aten op is called
directly: Dynamo rewrites the method `addcmul_(..., value=v)` into a multiply and a fused
multiply-add (CUDA's rounding), another float32 result than the CPU kernel's. AdamW's
`param.mul_(1 - lr * wd)` is the float64 product rounded once to the parameter's dtype, as the kernel
rounds the Python float. SGD's fresh momentum buffer (zeros flagged fresh, dense_update.py) is scaled
by -0.0 and the gradient added at alpha 1 (not 1 - dampening): exactly torch.optim's clone, signed
zeros included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Hp = dict[str, Any]  # a param group's hyperparameters but its params and lr


def _sgd(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # sgd.py `_single_tensor_sgd`
    if hp["weight_decay"] != 0:
        grad = _add(grad, param, hp["weight_decay"])
    if hp["momentum"] != 0:
        buf, fresh = state
        # torch.optim: a fresh buffer is grad.clone(), then buf.mul_(momentum).add_(grad, alpha=1 -
        # dampening). Here the fresh buffer is zeros scaled by -0.0 and grad added at alpha 1: -0.0
        # + x is x for every x, signed zeros included, so the first step is the clone bit for bit
        first = fresh > 0
        scale = torch.where(first, torch.full_like(fresh, -0.0), torch.full_like(fresh, hp["momentum"]))
        alpha = torch.where(first, torch.ones_like(fresh), torch.full_like(fresh, 1 - hp["dampening"]))
        _addcmul_(buf.mul_(_scalar(scale, buf)), grad, _scalar(alpha, buf))
        fresh.zero_()
        grad = _add(grad, buf, hp["momentum"]) if hp["nesterov"] else buf
    # param.add_(grad, alpha=-lr)
    _addcmul_(param, grad, _scalar(-lr, param))


def _adagrad(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # adagrad.py `_single_tensor_adagrad`, its float arithmetic in float64
    step_t, state_sum = state
    step_t += 1
    if hp["weight_decay"] != 0:
        grad = _add(grad, param, hp["weight_decay"])
    clr = lr / (1 + (step_t.to(lr.dtype) - 1) * hp["lr_decay"])
    _addcmul_(state_sum, grad, grad, value=1)
    std = state_sum.sqrt().add_(hp["eps"])
    param.add_(grad * _scalar(-clr, param) / std)  # param.addcdiv_(grad, std, value=-clr)


def _adam(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # adam.py `_single_tensor_adam` (not capturable), its float arithmetic in float64; AdamW is
    # decoupled_weight_decay=True
    step_t, exp_avg, exp_avg_sq = state[:3]
    beta1, beta2 = hp["betas"]
    step_t += 1
    if hp["weight_decay"] != 0:
        if hp["decoupled_weight_decay"]:
            param.mul_(_scalar(1 - lr * hp["weight_decay"], param))  # Python's float64 `1 - lr * wd`
        else:
            grad = _add(grad, param, hp["weight_decay"])
    torch.ops.aten.lerp_.Scalar(exp_avg, grad, 1 - beta1)
    _addcmul_(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2)
    step = step_t.to(lr.dtype)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    step_size = lr / bias_correction1
    # Python's `x ** 0.5` is C pow(x, 0.5); torch's pow by the Scalar 0.5 is a sqrt: pow by a tensor
    # (made like `step`: on a TPU a host tensor made in the graph is no program input)
    bias_correction2_sqrt = torch.pow(bias_correction2, torch.full_like(step, 0.5))
    second = exp_avg_sq
    if hp["amsgrad"]:
        # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq): the same kernel, written back
        second = state[3].copy_(torch.maximum(state[3], exp_avg_sq))
    denom = (second.sqrt() / _scalar(bias_correction2_sqrt, param)).add_(hp["eps"])
    param.add_(exp_avg * _scalar(-step_size, param) / denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)


def _scalar(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float64 scalar (shape (1,), on the host) as the kernels use a Python float operand: rounded
    once to the tensor's dtype, 0-d (an op on device tensors takes a 0-d host tensor as a scalar;
    TorchTPU and the emulated device refuse a host tensor of another shape)."""
    return value.reshape(()).to(like.dtype)


def _addcmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float = 1) -> torch.Tensor:
    # the aten op itself: Dynamo rewrites the method `addcmul_(..., value=v)` into a multiply and a
    # fused multiply-add (tensor.py `method_addcmul_`, CUDA's rounding), which rounds once more than
    # the CPU kernel torch.optim's eager step runs
    return torch.ops.aten.addcmul_.default(out, a, b, value=value)


def _add(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    # `a.add(b, alpha=alpha)` with a float alpha, torch.optim's own kernel (the aten op, as _addcmul_)
    return torch.ops.aten.add.Tensor(a, b, alpha=alpha)


UPDATE = {"sgd": _sgd, "adagrad": _adagrad, "adam": _adam}
