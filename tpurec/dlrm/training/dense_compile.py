"""`tpurec train --compile-dense`: the model's dense modules each run as torch.compile programs while
the embedding lookups and updates stay eager.

On a TPU v5e the eager step of MLPerf DLRM-DCNv2 spent 62.5 ms in the dense forward and backward
(session 35's split: each op one TorchTPU program, dispatched one by one), where the same MLPs fused
by XLA need a fraction of that; `--step compiled` puts the whole step in one graph, but its
embedding half changes more at once (fixed limits, the dense update traced). Here only the modules
that hold no embedding table are compiled, each as a whole: the walk from the model's root compiles
a child with parameters and no embedding module in it (the built-in DLRM's dense, interaction and
over arches), and goes into a child that holds one. Their `forward` is replaced, not the module, so
`state_dict()` keys, checkpoints and the optimizer's parameters stay as they are; Dynamo lifts the
parameters into graph inputs (TorchTPU's backend would freeze a graph's `get_attr` tensors as
constants, docs/tpu.md: a test checks none is left). The backend is
TorchTPU's "tpu" on a TPU (the emulated device's stand-in on an emulated rank), AOTAutograd run by
the eager kernels ("aot_eager") elsewhere: the same numbers as eager there.
"""

from __future__ import annotations

from typing import Any

import torch

from tpurec.runtime.device import DeviceKind


def _embedding_kinds() -> tuple[type, ...]:
    from torchrec.distributed.types import ShardedModule
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface

    return (EmbeddingBagCollectionInterface, EmbeddingCollectionInterface, ShardedModule)


def backend_for(device: str) -> str:
    return "tpu" if device == DeviceKind.TPU else "aot_eager"


def compile_dense(model: torch.nn.Module, device: str, backend: Any = None) -> list[str]:
    """Compile the dense modules of `model` in place (module docstring); their names, in order.
    backend: Dynamo's, by default the device's (`backend_for`)."""
    backend, kinds = backend or backend_for(device), _embedding_kinds()
    names: list[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, kinds):  # an embedding module (sharded or not): eager, as it is
                continue
            if any(isinstance(m, kinds) for m in child.modules()):
                visit(child, f"{path}.")
            elif any(True for _ in child.parameters()):
                compiled: Any = torch.compile(child.forward, backend=backend, dynamic=False)
                child.forward = compiled
                names.append(path)

    visit(model, "")
    return names
