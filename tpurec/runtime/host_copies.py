"""Device->host copies on the TPU path: made in one place, and counted.

On a TPU every copy of a device tensor to the host is a synchronisation point (the host waits for
the device to reach it). tpurec keeps the ids on the host from the reader to SparseCore
preprocessing (`tpurec.data.host_ids`), so the copies that remain are the ones a step needs to
report (the loss, read once per log interval) and the ones a caller causes by handing a KJT that is
already on the TPU to a SparseCore module. Every such copy in tpurec goes through `to_host`, which
counts it by what was copied; `tpurec train` reports the count per training step.

An emulated TPU rank (tpurec.emulation) holds CPU tensors only, so "on the device" cannot be read
from `tensor.device` there: the emulation marks the tensors a real rank would hold on the TPU (the
ones moved there by a batch's `.to(device)`), and `on_device` reads that mark.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, overload

import torch

from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_MARK = "_tpurec_on_device"
_counts: Counter = Counter()


def on_device(t: torch.Tensor | None) -> bool:
    """Whether `t` is off the host (on an accelerator, or on an emulated TPU rank, would be)."""
    if t is None:
        return False
    return t.device.type != DeviceKind.CPU or bool(getattr(t, _MARK, False))


def mark_on_device(t: torch.Tensor | None) -> None:
    """Emulation only: `t` is a CPU tensor a real TPU rank would hold on its TPU."""
    if t is not None:
        setattr(t, _MARK, True)


def _kjt_on_device(kjt: KeyedJaggedTensor) -> bool:
    return on_device(kjt.values()) or on_device(kjt.lengths())


@overload
def to_host(x: torch.Tensor, what: str) -> torch.Tensor: ...


@overload
def to_host(x: KeyedJaggedTensor, what: str) -> KeyedJaggedTensor: ...


def to_host(x: torch.Tensor | KeyedJaggedTensor, what: str) -> torch.Tensor | KeyedJaggedTensor:
    """`x` (a tensor or a KeyedJaggedTensor) on the host, counting a copy under `what` when it was on
    the device. A tensor already on the host is returned as it is."""
    if isinstance(x, torch.Tensor):
        if not on_device(x):
            return x
        _counts[what] += 1
        return x.to(torch.device("cpu")) if x.device.type != DeviceKind.CPU else x
    if not _kjt_on_device(x):
        return x
    _counts[what] += 1
    return x.to(torch.device("cpu")) if x.values().device.type != DeviceKind.CPU else x


def count(what: str) -> None:
    """A device->host copy made elsewhere (an asynchronous one into pinned memory: host_tier/
    device_copies.py), counted as `to_host` counts its own."""
    _counts[what] += 1


def counts() -> dict[str, int]:
    """Copies counted so far in this process, by what was copied."""
    return dict(sorted(_counts.items()))


def total() -> int:
    return sum(_counts.values())


def reset() -> None:
    _counts.clear()
