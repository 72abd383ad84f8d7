"""The eager step's dense update as one compiled program, beside `--compile-dense`'s arches.

torch.optim's Adagrad on a TorchTPU device steps each parameter of the DCNv2 arches op by op, every op
a program of its own: 8.0 ms a step of MLPerf DLRM-DCNv2 on a v5e for 16M parameters (session 36's
`split`, `dense_update_ms`), where the arithmetic reads and writes ~256 MB. The compiled and pipelined
steps already update the dense parameters inside their graph with `DenseOptimizer` (the optimizer's
single-tensor arithmetic, the lr a graph input so a schedule compiles nothing new, the state its
own: checkpoints unchanged). Here its `apply` is compiled alone and put in the place of the torch
optimizer's `step`; the gradients arrive averaged (DDP's backward in the eager step), so it is told
one rank. Optimizers or settings `DenseOptimizer` does not implement keep torch.optim's own step.

DDP (TorchRec's DMP wraps the dense arches with `gradient_as_bucket_view=True`) leaves each gradient
a view into a flat bucket. Dynamo hands a view's storage offset to the graph as a symbol even under
`dynamic=False`, and TorchTPU's backend then fails ("No bounds found for SymInt s67/512 + 3456": the
v5e, session 37). So the buckets go in whole and each gradient is cut from its bucket in the graph at
an offset that is a constant of the graph (`_GradSlices`); DDP rebuilds its buckets once after the
first step, a second graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tpurec.errors import UserError
from tpurec.runtime import env_flags

# TPUREC_DENSE_FOREACH_COPY=1: the graph returns the updated tensors and one `_foreach_copy_` puts
# them back (`_copy_back`), instead of mutating them in the graph
FOREACH_SWITCH = "TPUREC_DENSE_FOREACH_COPY"


def compile_dense_update(optimizer: Any, module: torch.nn.Module, device: str, backend: Any = None) -> str:
    """Make `optimizer`'s dense torch.optim step (the trainer's CombinedOptimizer: its fused table
    optimizer is left alone) a compiled `DenseOptimizer.apply`; what was done, in a few words."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.dlrm.training.dense_compile import backend_for
    from tpurec.sharding.step.dense_update import DenseOptimizer, scalar_device

    params = [p for _, p in in_backward_optimizer_filter(module.named_parameters())]
    if not params:
        return "no dense parameter"
    try:
        dense = DenseOptimizer(optimizer, params, None, 1, scalar_device(params))
    except UserError as e:  # an optimizer or setting it does not implement: torch.optim's own step
        return f"the dense update stays eager ({e})"
    flat_params = dense.flat_params()

    def update(lrs: Any, states: Any, bases: list[torch.Tensor], cuts: tuple[Any, ...]) -> Any:
        grads = [_GradSlices.cut(bases, c) for c in cuts]
        if not foreach:
            return dense.apply_grads(lrs, states, grads)
        # updates copies and returns them: no input is mutated in the graph (see `_copy_back`)
        with torch.no_grad():
            new_params = [p.clone() for p in flat_params]
            new_states = [[[t.clone() for t in s] for s in group] for group in states]
            dense.apply_grads(lrs, new_states, grads, into=new_params)
        return new_params, new_states

    foreach = env_flags.is_on(FOREACH_SWITCH)
    compiled: Any = torch.compile(update, backend=backend or backend_for(device), fullgraph=True, dynamic=False)

    def step(closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # torch.optim's contract: the closure re-evaluates the loss first
            with torch.enable_grad():
                loss = closure()
        slices = _GradSlices([p.grad for p in flat_params])
        # cleared before the graph (it clears them anyway): a parameter whose `.grad` is a bucket's view,
        # wrapped by Dynamo as a graph input, would bring the bucket in as a view's base, its size a
        # symbol (TorchTPU's backend has no bound for it, as for the offsets below)
        for p in flat_params:
            p.grad = None
        states = dense.state_inputs()
        out = compiled(dense.lr_inputs(), states, slices.bases, slices.cuts)
        if foreach:
            _copy_back([*flat_params, *_flat(states)], [*out[0], *_flat(out[1])])
        return loss

    dense.optimizer.step = step  # type: ignore[method-assign]  # what KeyedOptimizerWrapper.step calls
    return f"the dense update ({dense.kind}, {len(params)} tensors) compiled"


def _flat(states: Any) -> list[torch.Tensor]:
    return [t for group in states for s in group for t in s]


def _copy_back(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """The updated parameters and state into the live tensors, one `_foreach_copy_` per device.

    A graph that mutated them in place would get AOTAutograd's mutation epilogue: TorchTPU's backend
    compiles with `keep_inference_input_mutations=False` (docs/tpu.md), so each mutated input is
    copied back by an eager `copy_` of its own after the graph (a parameter's with a `detach` too),
    ~100 ops a step for MLPerf DLRM-DCNv2's ~25 dense tensors under Adagrad, each a TorchTPU
    dispatch. TorchTPU has a kernel of its own for `_foreach_copy_` (torchtpu_kernels.json): one
    dispatch per device. Copies, not rebinding: what aliases a parameter or a state tensor
    (`state_dict()`, a checkpoint's view) keeps seeing the live values. Opt-in (FOREACH_SWITCH): its
    one v5e run (session 38) was not faster than the in-place graph's (docs/results.md)."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, v in zip(targets, values, strict=True):
        dst, src = by_device.setdefault(t.device, ([], []))
        dst.append(t)
        src.append(v)
    with torch.no_grad():
        for dst, src in by_device.values():
            torch._foreach_copy_(dst, src)


class _GradSlices:
    """The gradients as graph inputs without views: the tensors the graph takes (`bases`: a DDP
    bucket once for all its views, any other gradient itself) and, per gradient, where it lies
    (`cuts`: None for no gradient, (base, None, None) for a whole tensor, (base, offset, shape) for a
    contiguous slice of a flat bucket), plain ints the graph holds as constants."""

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.bases: list[torch.Tensor] = []
        index: dict[int, int] = {}
        cuts: list[tuple[int, int | None, tuple[int, ...] | None] | None] = []
        for g in grads:
            if g is None:
                cuts.append(None)
                continue
            base = g._base
            sliceable = base is not None and base.dim() == 1 and base.is_contiguous() and g.is_contiguous()
            whole: torch.Tensor = base if sliceable and base is not None else g
            if id(whole) not in index:
                index[id(whole)] = len(self.bases)
                self.bases.append(whole)
            if sliceable:
                cuts.append((index[id(whole)], int(g.storage_offset() - whole.storage_offset()), tuple(g.shape)))
            else:
                cuts.append((index[id(whole)], None, None))
        self.cuts = tuple(cuts)

    @staticmethod
    def cut(bases: list[torch.Tensor], cut: Any) -> torch.Tensor | None:
        """One gradient, in the graph: its tensor, or its slice of its bucket."""
        if cut is None:
            return None
        base, offset, shape = cut
        if offset is None:
            return bases[base]
        return bases[base].narrow(0, offset, math.prod(shape)).view(shape)
