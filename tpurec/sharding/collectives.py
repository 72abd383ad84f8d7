"""Uneven all-to-all through an even one, for process groups that only do even all_to_all_single.

TorchTPU's `tpu_dist` backend supports `all_to_all_single` with equal splits only (docs/dmp.md, "TPU readiness"), but
TorchRec's input and output distributions send uneven splits (row-wise buckets, variable batch).
`padded_all_to_all_single` pads every chunk to the largest chunk any rank sends (agreed with one
all_reduce(MAX)), runs the even collective, and copies the valid rows out. `install()` routes
`torch.distributed.all_to_all_single` (which TorchRec calls) through it for such groups.

The padded path is exercised on CPU/gloo by forcing it (TPUREC_PADDED_ALL_TO_ALL=1, or
install(force=True)); it has not yet run on TPU hardware.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

# Backends that need padding: the names TorchTPU (torch-tpu 0.2.0) registers its backend under.
EVEN_ONLY_BACKENDS = {"tpu", "tpu_dist"}

_original = None
_forced = False
calls = {"padded": 0, "passthrough": 0}  # observed by tests and diagnostics


class _PaddedWork:
    """Work handle whose wait() also unpads into the caller's output tensor."""

    def __init__(self, work, finish):
        self._work, self._finish, self._done = work, finish, False

    def wait(self, *args, **kwargs):
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        if not self._done:
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())

    def get_future(self):  # pragma: no cover - only for callers that chain futures
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _even(n: int, world: int, what: str) -> list[int]:
    if n % world:
        raise ValueError(f"all_to_all_single: {what} has {n} rows, not divisible by world size {world}")
    return [n // world] * world


def padded_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                             async_op=False):
    send = _original or dist.all_to_all_single
    world = dist.get_world_size(group)
    in_splits = list(input_split_sizes) if input_split_sizes else _even(input.shape[0], world, "input")
    out_splits = list(output_split_sizes) if output_split_sizes else _even(output.shape[0], world, "output")
    chunk = torch.tensor([max(in_splits + out_splits + [0])], dtype=torch.int64, device=input.device)
    dist.all_reduce(chunk, op=dist.ReduceOp.MAX, group=group)
    chunk = int(chunk.item())
    calls["padded"] += 1
    rest = tuple(input.shape[1:])
    padded_in = input.new_zeros((world * chunk, *rest))
    src = 0
    for r, n in enumerate(in_splits):
        padded_in[r * chunk:r * chunk + n] = input[src:src + n]
        src += n
    padded_out = output.new_empty((world * chunk, *rest))
    work = send(padded_out, padded_in, group=group, async_op=async_op)

    def finish():
        dst = 0
        for r, n in enumerate(out_splits):
            output[dst:dst + n] = padded_out[r * chunk:r * chunk + n]
            dst += n

    if async_op:
        return _PaddedWork(work, finish)
    finish()
    return None


def _needs_padding(group) -> bool:
    if _forced:
        return True
    try:
        return dist.get_backend(group) in EVEN_ONLY_BACKENDS
    except (RuntimeError, ValueError):
        return False


def _routed(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    uneven = bool(output_split_sizes) or bool(input_split_sizes)
    if uneven and _needs_padding(group):
        return padded_all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)
    calls["passthrough"] += 1
    return _original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def install(force: bool | None = None) -> None:
    """Route uneven torch.distributed.all_to_all_single calls on even-only groups through padding.

    force=True (or TPUREC_PADDED_ALL_TO_ALL=1) pads on every backend, to test the path on CPU.
    Idempotent.
    """
    global _original, _forced
    if force is None:
        force = os.environ.get("TPUREC_PADDED_ALL_TO_ALL") == "1"
    _forced = _forced or bool(force)
    if _original is None:
        _original = dist.all_to_all_single
        dist.all_to_all_single = _routed
