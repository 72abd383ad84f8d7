"""Every bulk host->device copy of the TPU path (a batch's inputs, the host tier's loaded rows) and the
host tier's device->host write-backs in one place, so the route can change in one place: torch's
`.to(device)` / `.cpu()` through TorchTPU, or, with TPUREC_H2D=jax, JAX's `device_put` handed to torch
by DLPack (and a device tensor read by JAX through DLPack, its copy to the host started at once:
`start_to_host`).

Why a second route: on the v5e, TorchTPU's host->device copies ran at ~130-190 MB/s (session 34: the
host tier's rows, the ~42 MB of a step's inputs; docs/results.md), far under a host link's rate, and
TorchTPU runs on JAX's PJRT client in the same process. Whether `jax.device_put` is faster there and
whether `torch.from_dlpack` takes its array as a TorchTPU tensor is what chip probe 11's `jax_*`
pieces measure (scripts/tpu_probe_host_link.py); until they have, the switch stays off. Where the
route fails (DLPack refused, the array on another device) the copy falls back to `.to(device)`, said
once on stderr, so turning it on never stops a run.
"""

from __future__ import annotations

import warnings

import torch

from tpurec.runtime import env_flags
from tpurec.runtime.device import on_torchtpu

ROUTE_ENV = "TPUREC_H2D"
_REFUSED: list[str] = []  # why the JAX route fell back, once (tests and the probe read it)


def route() -> str:
    """ "jax" when TPUREC_H2D asks for it, else "torch"."""
    return "jax" if env_flags.get(ROUTE_ENV) == "jax" else "torch"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device`, by the route `route()` names where `device` is a TorchTPU one."""
    if route() == "jax" and on_torchtpu(device) and not _REFUSED:
        return via_jax(t, device)
    return t.to(device)


def via_jax(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` moved by `jax.device_put` onto JAX's device of `device`'s index and taken by torch through
    DLPack; `.to(device)` where that fails or lands elsewhere (said once). bfloat16 crosses as its bits
    (numpy has no bfloat16)."""
    import jax

    bf16 = t.dtype == torch.bfloat16
    host = (t.view(torch.int16) if bf16 else t).contiguous().numpy()
    try:
        out = torch.from_dlpack(jax.device_put(host, jax.devices()[device.index or 0]))
        if out.device.type != device.type:
            raise RuntimeError(f"DLPack gave a tensor on {out.device}, not {device}")
    except Exception as ex:  # the route refused here: torch's own copy from now on
        _REFUSED.append(f"{type(ex).__name__}: {str(ex)[:300]}")
        warnings.warn(f"{ROUTE_ENV}=jax: {_REFUSED[0]}; host->device copies go through torch", stacklevel=2)
        return t.to(device)
    return out.view(torch.bfloat16) if bf16 else out


class HostCopy:
    """A device->host copy started by `start_to_host`; `result()` waits for it and gives the host tensor."""

    def __init__(self, source: torch.Tensor, array: object | None) -> None:
        self.source, self.array = source, array  # the device rows, held until the copy is read

    def result(self) -> torch.Tensor:
        if self.array is None:  # the route refused (or torch's): torch's own, synchronous copy now
            return self.source.cpu()
        import numpy as np

        bf16 = self.source.dtype == torch.bfloat16
        out = torch.from_numpy(np.asarray(self.array).copy())
        self.array = None
        return out.view(torch.bfloat16) if bf16 else out


def start_to_host(t: torch.Tensor) -> HostCopy:
    """With the JAX route on a TorchTPU device, `t`'s copy to the host started now and not waited for
    (JAX's `copy_to_host_async` on the DLPack view): what a write-back needs to overlap the device's
    next steps without pinned memory. Else (or where refused, said once) a copy made at `result()`."""
    if not (route() == "jax" and on_torchtpu(t.device) and not _REFUSED):
        return HostCopy(t, None)
    import jax.dlpack

    try:
        array = jax.dlpack.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)
        array.copy_to_host_async()
    except Exception as ex:
        _REFUSED.append(f"{type(ex).__name__}: {str(ex)[:300]}")
        warnings.warn(f"{ROUTE_ENV}=jax: {_REFUSED[0]}; device->host copies go through torch", stacklevel=2)
        return HostCopy(t, None)
    return HostCopy(t, array)
