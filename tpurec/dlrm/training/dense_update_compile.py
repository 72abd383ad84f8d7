"""The eager step's dense update as one compiled program, beside `--compile-dense`'s arches.

torch.optim's Adagrad on a TorchTPU device steps each parameter of the DCNv2 arches op by op, every op
a program of its own: 8.0 ms a step of MLPerf DLRM-DCNv2 on a v5e for 16M parameters (session 36's
`split`, `dense_update_ms`), where the arithmetic reads and writes ~256 MB. The compiled and pipelined
steps already update the dense parameters inside their graph with `DenseOptimizer` (the optimizer's
single-tensor arithmetic, the lr a graph input so a schedule compiles nothing new, the state its
own: checkpoints unchanged). Here its `apply` is compiled alone and put in the place of the torch
optimizer's `step`; the gradients arrive averaged (DDP's backward in the eager step), so it is told
one rank. Optimizers or settings `DenseOptimizer` does not implement keep torch.optim's own step.
"""

from __future__ import annotations

from typing import Any

import torch

from tpurec.errors import UserError


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
    compiled: Any = torch.compile(dense.apply, backend=backend or backend_for(device), fullgraph=True, dynamic=False)

    def step(closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # torch.optim's contract: the closure re-evaluates the loss first
            with torch.enable_grad():
                loss = closure()
        compiled(dense.lr_inputs(), dense.state_inputs())
        return loss

    dense.optimizer.step = step  # type: ignore[method-assign]  # what KeyedOptimizerWrapper.step calls
    return f"the dense update ({dense.kind}, {len(params)} tensors) compiled"
