"""The SparseCore stages of `PipelinedStep` (pipelined.py) on a batch in flight, per sharded EBC or EC:
its forward (`lookups`), the batch's inputs replaced by the looked-up activations (`activated`), the
batch past its model stage (`behind`) and its backward (`updates`)."""

from __future__ import annotations

from typing import Any

from tpurec.sharding.ec_preprocess import ShardedECPreprocessed, lookup_sharded_ec, update_sharded_ec
from tpurec.sharding.sharded_preprocess import (
    RawActivations,
    ShardedActivations,
    ShardedPreprocessed,
    lookup_sharded,
    update_sharded,
)
from tpurec.sharding.step import inputs as step_inputs

# per sharded EBC or EC (step_inputs.parts order): a batch's host half and its activations' gradients
Prepared = ShardedPreprocessed | ShardedECPreprocessed
Behind = list[tuple[Prepared, RawActivations]]


def lookups(prepared: list[Prepared]) -> list[RawActivations]:
    """SparseCore forward of each sharded EBC's and EC's inputs."""
    return [
        lookup_sharded_ec(p.owner, p) if isinstance(p, ShardedECPreprocessed) else lookup_sharded(p.owner, p)
        for p in prepared
    ]


def begin_updates(behind: Behind) -> None:
    """The eager half of `updates`, before it (compiled or not): each kernel's step counted and its
    scalars written at the tables' lr now (`SparseCoreKernel.begin_compiled_step`, step_scalars.py)."""
    for prepared, _ in behind:
        for kernel in step_inputs.kernels(prepared.owner):
            kernel.begin_compiled_step()


def updates(behind: Behind) -> None:
    """SparseCore backward of each sharded EBC's inputs from its activations' gradients."""
    for prepared, grads in behind:
        if isinstance(prepared, ShardedECPreprocessed):
            update_sharded_ec(prepared.owner, prepared, grads)
        else:
            update_sharded(prepared.owner, prepared, grads)


def behind(ahead: Any, grads: list[RawActivations]) -> Behind:
    """A batch past its model stage: each sharded EBC's inputs with its activations' gradients."""
    return [(acts.prepared, g) for acts, g in zip(step_inputs.parts(ahead), grads, strict=True)]


def activated(batch: Any, prepared: list[Prepared], raw: list[RawActivations]) -> Any:
    """A prepared `batch` with each sharded EBC's inputs replaced by its looked-up activations, as
    leaves the model's backward fills."""
    for per_module in raw:
        for kernels in per_module:
            for stacks in kernels:
                for a in stacks:
                    a.requires_grad_()
    return step_inputs.with_parts(batch, [ShardedActivations(p, r) for p, r in zip(prepared, raw, strict=True)])
