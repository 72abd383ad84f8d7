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

Which optimizers and settings it implements: dense_supported.py; the per-parameter arithmetic,
bit-equal to torch.optim's: dense_arithmetic.py. Adam's state (and amsgrad's max_exp_avg_sq) is made
up front as its first step makes it. SGD's momentum buffer, which torch.optim makes on a parameter's
first step as `clone(grad)`, is made by `state_inputs` (the graph cannot add state) as zeros flagged
fresh; the graph's step makes exactly the clone of a fresh buffer and clears the flag. The compiled
steps take their inputs before the backward, so every parameter gets its buffer then, gradient or
not. Until its first step such a buffer is none of torch.optim's: hooks on the optimizer leave it
out of `state_dict()` and drop it before torch.optim's own `step()` (which then makes the clone
itself). TorchRec's KeyedOptimizer reads `state` directly: its checkpoint holds such a zero buffer,
which a resumed step takes as a stepped one (with dampening, that first step differs).

The dense gradients are averaged over the ranks in one bucket: DDP's division by the world size,
then one functional all-reduce of their concatenation (on TorchTPU every collective is a program of
its own), split back; each element is summed over the same ranks as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tpurec.runtime.device import on_torchtpu
from tpurec.sharding.step.dense_arithmetic import UPDATE
from tpurec.sharding.step.dense_supported import check_groups, kind_of, torch_optimizer


class DenseOptimizer:
    """`apply(lrs, states)` in the graph: the dense update; `lr_inputs()` / `state_inputs()` outside
    it, each step: the graph's arguments."""

    def __init__(
        self,
        optimizer: Any,
        dense_params: Sequence[torch.Tensor],
        group: Any,
        world_size: int,
        scalars_on: torch.device | None = None,
    ) -> None:
        """scalars_on: where the lrs, SGD's fresh flags and the optimizer's step counts live as graph
        inputs. None: on the host, float64 (torch.optim's own arithmetic, bit-equal). A TorchTPU
        device: there, float32 (`on_torchtpu`): a TorchTPU program takes no host tensor as an argument
        (the v5e: "expected tensor to be on tpu, got cpu", docs/tpu.md), and the TPU's units have no
        native float64 (float64 through TorchTPU not tried)."""
        self.optimizer = torch_optimizer(optimizer, dense_params)
        self.scalars_on = scalars_on
        dtype = torch.float64 if scalars_on is None else torch.float32
        self.kind = kind_of(self.optimizer)
        self.group, self.world_size = group, world_size
        check_groups(self.optimizer, self.kind)
        # the float hyperparameters are the graph's constants; the lr is an input (lr_inputs)
        self._groups: list[dict[str, Any]] = [
            {k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups
        ]
        self._params: list[list[torch.Tensor]] = [list(g["params"]) for g in self.optimizer.param_groups]
        # shape (1,), not 0-d: Dynamo reads a 0-d CPU tensor's value into a symbol (and restarts its
        # analysis once to specialize it away); a 1-element tensor is plain data
        self._lrs = [torch.zeros(1, dtype=dtype, device=scalars_on) for _ in self._params]
        if self.kind == "adam":
            self._init_adam_state()
        # SGD's momentum buffers: torch.optim makes each on its parameter's first step, as a clone
        # of the gradient; the graph cannot add a state entry, so `state_inputs` makes it (zeros)
        # before that step and flags it fresh here (1.0, float64 (1,) like the lrs): the graph's
        # first step then computes exactly the clone (dense_arithmetic.py `_sgd`) and clears the flag
        self._fresh = [[torch.zeros(1, dtype=dtype, device=scalars_on) for _ in ps] for ps in self._params]
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
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device=self.scalars_on)
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
            out.append([[self._on_scalar_device(p, k) for k in keys] for p in ps])
        return out

    def _on_scalar_device(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """The state tensor `key` of `p`; a step count moved to `scalars_on` (in the optimizer's
        state: torch.optim's eager step reads a device step count as well, `_get_value`) when a
        resume or torch.optim's own init left it on the host."""
        state = self.optimizer.state[p]
        t: torch.Tensor = state[key]
        if self.scalars_on is not None and key == "step" and t.device != self.scalars_on:
            t = state[key] = t.to(self.scalars_on)
        return t

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

    def flat_params(self) -> list[torch.Tensor]:
        """Every group's parameters in order: the order `apply_grads` takes their gradients in."""
        return [p for ps in self._params for p in ps]

    def apply(self, lrs: Sequence[torch.Tensor], states: Sequence[Sequence[Sequence[torch.Tensor]]]) -> None:
        """The update of every parameter that has a gradient, averaged over the ranks first; clears
        the gradients. Traceable; eagerly it computes the same numbers."""
        self.apply_grads(lrs, states, [p.grad for p in self.flat_params()])

    def apply_grads(
        self,
        lrs: Sequence[torch.Tensor],
        states: Sequence[Sequence[Sequence[torch.Tensor]]],
        given: Sequence[torch.Tensor | None],
        into: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """`apply` with each parameter's gradient handed in (`given`, every group's parameters in
        order; None: no update): dense_update_compile.py hands DDP's bucket views in as slices of
        their buckets, so the graph sees no view's storage offset. `into`: tensors updated in the
        parameters' place (every group's in order; that module's copies). Clears the gradients."""
        with torch.no_grad():
            flat = iter(given)  # zip draws from it only while a group's parameters last
            targets = self._params if into is None else _grouped_like(into, self._params)
            groups = zip(targets, states)
            have = [[(p, s, g) for p, s, g in zip(ps, ss, flat) if g is not None] for ps, ss in groups]
            grads = _mean_over_ranks([g for pairs in have for _, _, g in pairs], self.group, self.world_size)
            i = 0
            for pairs, lr, hp in zip(have, lrs, self._groups):
                for p, s, _ in pairs:
                    UPDATE[self.kind](p, grads[i], s, lr, hp)
                    i += 1
            for ps in self._params:
                for p in ps:
                    p.grad = None


def _grouped_like(flat: Sequence[torch.Tensor], groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    it = iter(flat)
    return [[next(it) for _ in g] for g in groups]


def scalar_device(params: Sequence[torch.Tensor]) -> torch.device | None:
    """Where `DenseOptimizer`'s scalars go for these parameters: their device when it is a TorchTPU
    one (torch_tpu loaded: the emulated device, which has no such rule, keeps the host's float64
    arithmetic that its tests hold bit-equal to torch.optim), else None (the host)."""
    device = params[0].device if params else None
    return device if on_torchtpu(device) else None


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
