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

Implemented: SGD with weight_decay, momentum, dampening and nesterov; Adagrad with weight_decay and
lr_decay; Adam with weight_decay (L2) and amsgrad; AdamW (torch's Adam with decoupled_weight_decay:
`param.mul_(1 - lr * wd)`, the float64 product rounded once to the parameter's dtype, as the kernel
rounds the Python float). Adam's state (and amsgrad's max_exp_avg_sq) is made up front as its first
step makes it. SGD's momentum buffer, which torch.optim makes on a parameter's first step as
`clone(grad)`, is made by `state_inputs` (the graph cannot add state) as zeros flagged fresh; the
graph's step scales a fresh buffer by -0.0 and adds the gradient at alpha 1 (not 1 - dampening):
exactly the clone, signed zeros included, and clears the flag. The compiled steps take their
inputs before the backward, so every parameter gets its buffer then, gradient or not. Until its
first step such a buffer is none of torch.optim's: hooks on the optimizer leave it out of
`state_dict()` and drop it before torch.optim's own `step()` (which then makes the clone itself).
TorchRec's KeyedOptimizer reads `state` directly: its checkpoint holds such a zero buffer, which a
resumed step takes as a stepped one (with dampening, that first step differs). Refused in one line, by name: maximize,
Adam's capturable, foreach/fused/differentiable, hyperparameters given as tensors (but the lr), and
every other class.

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
_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"maximize": False},
    "adagrad": {"maximize": False},
    "adam": {"maximize": False, "capturable": False},
}
# hyperparameters torch.optim also takes as tensors (its `_to_scalar` path, other kernels): refused
# as tensors, taken as floats (the lr alone may be a tensor: it is read into `lr_inputs` each step)
_FLOATS = ("momentum", "dampening", "weight_decay", "lr_decay", "eps", "betas")


def _kind(optimizer: torch.optim.Optimizer) -> str:
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
            for key in _FLOATS:
                values = g.get(key)
                if any(isinstance(v, torch.Tensor) for v in (values if isinstance(values, tuple) else (values,))):
                    raise UserError(
                        f"the compiled/pipelined step's dense {type(self.optimizer).__name__} takes {key} as a "
                        f"float, not a tensor (give a float, or use the eager step)"
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
        # SGD's momentum buffers: torch.optim makes each on its parameter's first step, as a clone
        # of the gradient; the graph cannot add a state entry, so `state_inputs` makes it (zeros)
        # before that step and flags it fresh here (1.0, float64 (1,) like the lrs): the graph's
        # first step then computes exactly the clone (see `_sgd`) and clears the flag
        self._fresh = [[torch.zeros(1, dtype=torch.float64) for _ in ps] for ps in self._params]
        self._made: list[list[torch.Tensor | None]] = [[None for _ in ps] for ps in self._params]
        if self.kind == "sgd":
            # a buffer made but not stepped yet is none of torch.optim's: its own step and its
            # state_dict do not see it (TorchRec's KeyedOptimizer reads `state` itself: it does)
            self.optimizer.register_step_pre_hook(self._drop_unstepped)
            self.optimizer.register_state_dict_post_hook(self._without_unstepped)

    def _init_adam_state(self) -> None:
        """Adam's state as its first step makes it (adam.py `_init_group`, capturable and fused off):
        made now because the graph cannot add entries to the state dict."""
        from torch.optim.optimizer import _get_scalar_dtype

        for hp, ps in zip(self._groups, self._params):
            for p in ps:
                state = self.optimizer.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if hp["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def lr_inputs(self) -> list[torch.Tensor]:
        """Each param group's current lr (what LRSchedule set) as a float64 tensor: a graph input,
        so a new lr is new data, not a new graph."""
        for t, g in zip(self._lrs, self.optimizer.param_groups):
            t.fill_(float(g["lr"]))
        return self._lrs

    def state_inputs(self) -> list[list[list[torch.Tensor]]]:
        """The optimizer's own state tensors per group and parameter (adagrad: step, sum; adam: step,
        exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad; sgd with momentum: momentum_buffer and its
        fresh flag; sgd without: none), looked up now (a resume may have replaced them)."""
        out: list[list[list[torch.Tensor]]] = []
        for gi, (hp, ps) in enumerate(zip(self._groups, self._params)):
            if self.kind == "sgd":
                out.append([self._momentum_state(gi, i, p) if hp["momentum"] else [] for i, p in enumerate(ps)])
                continue
            keys: tuple[str, ...] = ("step", "sum") if self.kind == "adagrad" else ("step", "exp_avg", "exp_avg_sq")
            keys += ("max_exp_avg_sq",) if self.kind == "adam" and hp["amsgrad"] else ()
            out.append([[self.optimizer.state[p][k] for k in keys] for p in ps])
        return out

    def _momentum_state(self, gi: int, i: int, p: torch.Tensor) -> list[torch.Tensor]:
        """[momentum_buffer, fresh] of one parameter; the buffer made (zeros, flagged fresh) if it
        has none yet. Made whether or not a gradient is there yet: the compiled steps take their
        inputs before the backward that makes it."""
        state, fresh = self.optimizer.state[p], self._fresh[gi][i]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._made[gi][i] = buf
            fresh.fill_(1.0)
        elif buf is not self._made[gi][i]:
            fresh.fill_(0.0)  # an eager step's or a loaded one: the momentum applies
        return [buf, fresh]

    def _unstepped(self) -> list[torch.Tensor]:
        """The parameters whose momentum buffer is one made here and not stepped yet."""
        out = []
        for made, fresh, ps in zip(self._made, self._fresh, self._params):
            for buf, flag, p in zip(made, fresh, ps):
                if buf is not None and bool(flag) and self.optimizer.state.get(p, {}).get("momentum_buffer") is buf:
                    out.append(p)
        return out

    def _drop_unstepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # before torch.optim's own step: it makes these buffers itself, as clones of the gradients
        for p in self._unstepped():
            del optimizer.state[p]["momentum_buffer"]
            if not optimizer.state[p]:
                del optimizer.state[p]

    def _without_unstepped(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # the packed state's entries are the live state dicts: copied, not edited
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        packed = dict(state_dict["state"])
        for p in self._unstepped():
            entry = {k: v for k, v in packed[index[id(p)]].items() if k != "momentum_buffer"}
            if entry:
                packed[index[id(p)]] = entry
            else:
                del packed[index[id(p)]]
        return {**state_dict, "state": packed}

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
    clr = lr / (1 + (step_t.to(torch.float64) - 1) * hp["lr_decay"])
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
    step = step_t.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    step_size = lr / bias_correction1
    # Python's `x ** 0.5` is C pow(x, 0.5); torch's pow by the Scalar 0.5 is a sqrt: pow by a tensor
    bias_correction2_sqrt = torch.pow(bias_correction2, torch.full((), 0.5, dtype=torch.float64))
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
