"""The dense parameters' update of the compiled and pipelined steps: a torch.optim optimizer's own
step, written so `torch.compile(fullgraph=True)` traces it and a changing lr compiles nothing new.

`torch.optim`'s `step()` breaks the graph on purpose (optimizer.py `_use_grad`: a graph break before
and after), and a float lr read in the graph is a constant Dynamo guards on: every new lr of a
warm-up or decay would compile a new graph. So the update here is the optimizer's single-tensor CPU
step (`torch.optim.sgd/adagrad/adam._single_tensor_*`, what the eager trainer runs on CPU tensors)
with its Python-float arithmetic on float64 tensors: the lr of each param group comes in as a
float64 tensor argument of the graph (`lr_inputs`, refreshed from the param group before each step,
so `LRSchedule` drives it), and the optimizer's state tensors are its own (`state_inputs`: found
again every step, so a `load_state_dict` that replaces them is followed; checkpoints keep working).

The same numbers as torch.optim, op for op (bit-equal: tests/sharding/test_dense_update.py): a
float64 scalar tensor rounded to float32 is the float32 a kernel makes of a Python float operand;
`param.addcdiv_(a, b, value=-s)` is `param.add_(a * -s / b)` (the kernel's own order: scalar * a,
/ b, + param); `param.add_(g, alpha=-lr)` is `aten.addcmul_(param, g, -lr)`. The aten op is called
directly: Dynamo rewrites the method `addcmul_(..., value=v)` into a multiply and a fused
multiply-add (CUDA's rounding), another float32 result than the CPU kernel's.

The dense gradients are averaged over the ranks in one bucket: DDP's division by the world size,
then one functional all-reduce of their concatenation (on TorchTPU every collective is a program of
its own), split back; each element is summed over the same ranks as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tpurec.errors import UserError

SUPPORTED = ("sgd", "adagrad", "adam")  # tpurec.dlrm.options.STEP_DENSE_OPTIMIZERS checks --dense-optimizer
Hp = dict[str, Any]  # a param group's hyperparameters but its params and lr

# the options each kind's eager step would honour but this one does not implement: refused by name
# (their defaults are what the trainer's `--dense-optimizer` builds)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0, "weight_decay": 0, "nesterov": False, "maximize": False},
    "adagrad": {"weight_decay": 0, "maximize": False},
    "adam": {"weight_decay": 0, "amsgrad": False, "maximize": False, "capturable": False},
}


def _kind(optimizer: torch.optim.Optimizer) -> str:
    # the exact classes: a subclass (AdamW, RAdam ...) steps differently
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad", torch.optim.Adam: "adam"}
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


class DenseOptimizer:
    """`apply(lrs, states)` in the graph: the dense update; `lr_inputs()` / `state_inputs()` outside
    it, each step: the graph's arguments."""

    def __init__(self, optimizer: Any, dense_params: Sequence[torch.Tensor], group: Any, world_size: int) -> None:
        self.optimizer = torch_optimizer(optimizer, dense_params)
        self.kind = _kind(self.optimizer)
        self.group, self.world_size = group, world_size
        for g in self.optimizer.param_groups:
            # foreach/fused/differentiable: the eager step would run other kernels, other numbers
            for key in ("foreach", "fused", "differentiable"):
                if g.get(key):
                    raise UserError(
                        f"the compiled/pipelined step's dense {type(self.optimizer).__name__} runs torch.optim's "
                        f"single-tensor step, not {key}=True (leave it out, or use the eager step)"
                    )
            for key, default in _DEFAULTS[self.kind].items():
                if g.get(key, default) != default:
                    raise UserError(
                        f"the compiled/pipelined step's dense {type(self.optimizer).__name__} does not implement "
                        f"{key}={g[key]!r} (leave it out, or use the eager step)"
                    )
        # the float hyperparameters are the graph's constants; the lr is an input (lr_inputs)
        self._groups: list[dict[str, Any]] = [
            {k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups
        ]
        self._params: list[list[torch.Tensor]] = [list(g["params"]) for g in self.optimizer.param_groups]
        # shape (1,), not 0-d: Dynamo reads a 0-d CPU tensor's value into a symbol (and restarts its
        # analysis once to specialize it away); a 1-element tensor is plain data
        self._lrs = [torch.zeros(1, dtype=torch.float64) for _ in self._params]
        if self.kind == "adam":
            self._init_adam_state()

    def _init_adam_state(self) -> None:
        """Adam's state as its first step makes it (adam.py `_init_group`, capturable and fused off):
        made now because the graph cannot add entries to the state dict."""
        from torch.optim.optimizer import _get_scalar_dtype

        for p in (p for ps in self._params for p in ps):
            state = self.optimizer.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def lr_inputs(self) -> list[torch.Tensor]:
        """Each param group's current lr (what LRSchedule set) as a float64 tensor: a graph input,
        so a new lr is new data, not a new graph."""
        for t, g in zip(self._lrs, self.optimizer.param_groups):
            t.fill_(float(g["lr"]))
        return self._lrs

    def state_inputs(self) -> list[list[list[torch.Tensor]]]:
        """The optimizer's own state tensors per group and parameter (adagrad: step, sum; adam: step,
        exp_avg, exp_avg_sq; sgd: none), looked up now (a resume may have replaced them)."""
        keys = {"sgd": (), "adagrad": ("step", "sum"), "adam": ("step", "exp_avg", "exp_avg_sq")}[self.kind]
        return [[[self.optimizer.state[p][k] for k in keys] for p in ps] for ps in self._params]

    def apply(self, lrs: Sequence[torch.Tensor], states: Sequence[Sequence[Sequence[torch.Tensor]]]) -> None:
        """The update of every parameter that has a gradient, averaged over the ranks first; clears
        the gradients. Traceable; eagerly it computes the same numbers."""
        with torch.no_grad():
            have = [[(p, s) for p, s in zip(ps, ss) if p.grad is not None] for ps, ss in zip(self._params, states)]
            local: list[torch.Tensor] = []
            for pairs in have:
                local += [p.grad for p, _ in pairs if p.grad is not None]
            grads = _mean_over_ranks(local, self.group, self.world_size)
            i = 0
            for pairs, lr, hp in zip(have, lrs, self._groups):
                for p, s in pairs:
                    _UPDATE[self.kind](p, grads[i], s, lr, hp)
                    i += 1
            for ps in self._params:
                for p in ps:
                    p.grad = None


def _sgd(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # sgd.py `_single_tensor_sgd`: param.add_(grad, alpha=-lr)
    _addcmul_(param, grad, _scalar(-lr, param))


def _adagrad(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # adagrad.py `_single_tensor_adagrad`, its float arithmetic in float64
    step_t, state_sum = state
    step_t += 1
    clr = lr / (1 + (step_t.to(torch.float64) - 1) * hp["lr_decay"])
    _addcmul_(state_sum, grad, grad, value=1)
    std = state_sum.sqrt().add_(hp["eps"])
    param.add_(grad * _scalar(-clr, param) / std)  # param.addcdiv_(grad, std, value=-clr)


def _adam(param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], lr: torch.Tensor, hp: Hp) -> None:
    # adam.py `_single_tensor_adam` (not capturable), its float arithmetic in float64
    step_t, exp_avg, exp_avg_sq = state
    beta1, beta2 = hp["betas"]
    step_t += 1
    torch.ops.aten.lerp_.Scalar(exp_avg, grad, 1 - beta1)
    _addcmul_(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2)
    step = step_t.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    step_size = lr / bias_correction1
    # Python's `x ** 0.5` is C pow(x, 0.5); torch's pow by the Scalar 0.5 is a sqrt: pow by a tensor
    bias_correction2_sqrt = torch.pow(bias_correction2, torch.full((), 0.5, dtype=torch.float64))
    denom = (exp_avg_sq.sqrt() / _scalar(bias_correction2_sqrt, param)).add_(hp["eps"])
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


_UPDATE = {"sgd": _sgd, "adagrad": _adagrad, "adam": _adam}


def _mean_over_ranks(grads: list[torch.Tensor], group: Any, world_size: int) -> list[torch.Tensor]:
    """DDP's average in one bucket: each rank's gradients divided by the world size (its reducer
    divides before the all-reduce), concatenated, one functional all-reduce (Dynamo traces it), split."""
    if world_size == 1 or not grads:
        return grads
    import torch.distributed._functional_collectives as funcol

    flat = torch.cat([g.reshape(-1) for g in grads]) / world_size
    summed = funcol.all_reduce(flat, "sum", group)
    sizes = [g.numel() for g in grads]
    return [part.view_as(g) for part, g in zip(torch.split(summed, sizes), grads)]
