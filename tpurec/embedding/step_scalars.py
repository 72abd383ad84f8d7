"""A compiled step's per-step values (learning rate, Adam's bias-corrected step size, ...) as an input
of its graph, not values its ops read in Python.

TorchTPU compiles a graph by running it once on placeholders of its inputs (torch-tpu 0.2.0,
`_internal/compile/compiler.py`, `StaticCompiler._compile` -> `torch_tpu_export.fx_to_mlir`): the
Python of an opaque custom op in it (`custom_ops.fused_update`) runs then, once. Two things follow
(docs/tpu.md, "The compiled step"):

* a device tensor that Python makes from a host value (`torch.tensor(lr, device=...)`, what the update
  ops took their learning rates as) is data of the program that no input provides: the chip aborts,
  `compiled_mode.cc:417 ... identified an argument that was not provided: float32` (session 32);
* a value that Python reads (the param group's lr, the step count) would be frozen into the program.

So a compiled step's update takes its scalars from a small float32 tensor per kernel, one row per
stack (`SparseCoreKernel.step_feed`), that the eager half writes before each step
(`SparseCoreKernel.begin_compiled_step`, which also counts the step) and the graph takes as an input;
inside the op, `tpu_scalar` hands out that row's entries by name instead of
making tensors. The names and values a spec's TPU kernels ask for are its `device_scalars`; each
request is checked against them where the Python runs with real values (every step on the CPU and
the emulated device, the trace on a TPU), so a kernel asking for a value the feed does not hold, or
another value than it holds, fails loudly instead of training on a stale one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Feed:
    """One stack's row of the feed: `row` the device tensor (float32 [len(values)]), `values` what it
    holds this step, by name, as the host computed them."""

    row: torch.Tensor
    values: Mapping[str, float]

    def take(self, name: str, value: float) -> torch.Tensor:
        """The entry `name` (a 0-dim tensor of the row: an op on a graph input, no new data), after
        checking that `value`, what the caller computed, is what it holds (float32, as the device has it)."""
        names = list(self.values)
        if name not in self.values:
            raise AssertionError(f"a compiled step's update asked for {name!r}; its feed holds {names}")
        if np.float32(value) != np.float32(self.values[name]):
            raise AssertionError(
                f"a compiled step's update computed {name}={value!r}, its feed holds {self.values[name]!r} "
                "(OptimizerSpec.device_scalars and the TPU kernel's arguments disagree)"
            )
        return self.row[names.index(name)]


_FEED: ContextVar[Feed | None] = ContextVar("tpurec_step_feed", default=None)


@contextlib.contextmanager
def feeding(feed: Feed) -> Iterator[None]:
    """`tpu_scalar` takes its values from `feed` inside."""
    token = _FEED.set(feed)
    try:
        yield
    finally:
        _FEED.reset(token)


def current() -> Feed | None:
    return _FEED.get()


def host_row(values: Mapping[str, float]) -> torch.Tensor:
    """The row's host copy, float32, in the order of `values` (what `Feed.take` indexes)."""
    return torch.tensor([float(v) for v in values.values()], dtype=torch.float32)


def tpu_scalar(value: float, like: torch.Tensor, name: str) -> torch.Tensor:
    """TorchTPU takes learning rates (and Adam's alpha_t) as device tensors, so they can change per
    step without recompiling. `name`: the value's name in `OptimizerSpec.device_scalars`; inside a
    compiled step's update the value is that entry of the step's feed, since a tensor made there from
    a host value is not an input of the compiled program (module docstring)."""
    feed = current()
    if feed is not None:
        return feed.take(name, value)
    return torch.tensor(value, dtype=torch.float32, device=like.device)
