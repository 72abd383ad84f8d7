"""Which torch.optim optimizers and settings the dense update of the compiled and pipelined steps
(dense_update.py) implements: the optimizer found in what the step was given (`torch_optimizer`), its
kind (`kind_of`) and its param groups' settings checked (`check_groups`).

Implemented: SGD with weight_decay, momentum, dampening and nesterov; Adagrad with weight_decay and
lr_decay; Adam with weight_decay (L2) and amsgrad; AdamW (torch's Adam with decoupled_weight_decay).
Refused in one line, by name: maximize, Adam's capturable, foreach/fused/differentiable,
hyperparameters given as tensors (but the lr), and every other class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tpurec.errors import UserError

SUPPORTED = ("sgd", "adagrad", "adam")  # tpurec.dlrm.options.STEP_DENSE_OPTIMIZERS checks --dense-optimizer

# the options each kind's eager step would honour but this one does not implement: refused by name
_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"maximize": False},
    "adagrad": {"maximize": False},
    "adam": {"maximize": False, "capturable": False},
}
# hyperparameters torch.optim also takes as tensors (its `_to_scalar` path, other kernels): refused
# as tensors, taken as floats (the lr alone may be a tensor: it is read into `lr_inputs` each step)
_FLOATS = ("momentum", "dampening", "weight_decay", "lr_decay", "eps", "betas")


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    # the exact classes: another subclass steps differently; AdamW is Adam with
    # decoupled_weight_decay=True (torch/optim/adamw.py), the same step
    o = torch.optim
    kinds = {o.SGD: "sgd", o.Adagrad: "adagrad", o.Adam: "adam", o.AdamW: "adam"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise UserError(
            f"the compiled/pipelined step's dense update implements torch.optim "
            f"{', '.join(c.__name__ for c in kinds)}, not {type(optimizer).__name__} (use the eager step)"
        )
    return kind


def torch_optimizer(given: Any, dense_params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer over `dense_params` in `given`: a float (plain SGD at that lr, built
    here), a torch.optim optimizer, TorchRec's KeyedOptimizerWrapper, or a CombinedOptimizer holding
    one (the trainer's `build_optimizer`: the fused table optimizer beside it is skipped)."""
    if isinstance(given, (int, float)):
        return torch.optim.SGD(list(dense_params), lr=float(given))
    wanted = {id(p) for p in dense_params}
    candidates = [given]
    if hasattr(given, "optimizers"):  # CombinedOptimizer: [(key, KeyedOptimizer)]
        candidates = [opt for _, opt in given.optimizers]
    for c in candidates:
        inner = getattr(c, "_optimizer", c)  # KeyedOptimizerWrapper wraps the torch.optim one
        if isinstance(inner, torch.optim.Optimizer):
            held = {id(p) for g in inner.param_groups for p in g["params"]}
            if held == wanted:
                return inner
    raise UserError(
        f"no torch.optim optimizer over exactly the model's {len(wanted)} dense parameters in the "
        f"{type(given).__name__} given to the compiled/pipelined step"
    )


def check_groups(optimizer: torch.optim.Optimizer, kind: str) -> None:
    """Refuses, in one line by name, a param group setting the traceable update does not implement
    (`kind`: `kind_of(optimizer)`)."""
    for g in optimizer.param_groups:
        # foreach/fused/differentiable: the eager step would run other kernels, other numbers
        for key in ("foreach", "fused", "differentiable"):
            if g.get(key):
                raise UserError(
                    f"the compiled/pipelined step's dense {type(optimizer).__name__} runs torch.optim's "
                    f"single-tensor step, not {key}=True (leave it out, or use the eager step)"
                )
        for key in _FLOATS:
            values = g.get(key)
            if any(isinstance(v, torch.Tensor) for v in (values if isinstance(values, tuple) else (values,))):
                raise UserError(
                    f"the compiled/pipelined step's dense {type(optimizer).__name__} takes {key} as a "
                    f"float, not a tensor (give a float, or use the eager step)"
                )
        for key, default in _DEFAULTS[kind].items():
            if g.get(key, default) != default:
                raise UserError(
                    f"the compiled/pipelined step's dense {type(optimizer).__name__} does not implement "
                    f"{key}={g[key]!r} (leave it out, or use the eager step)"
                )
