"""Device resolution and TorchTPU detection.

Detection never imports torch_tpu or libtpu: on a host without a TPU, importing them can abort the
process or hang on the cloud metadata server (docs/tpu.md). We look at installed distributions and
at the device nodes a TPU VM exposes instead, and import torch_tpu only once a TPU is known to be
there and the caller asked for it.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass

# Device nodes of a Cloud TPU VM: /dev/accel* (v4, v5e, v5p) and /dev/vfio/<n> (v6e, v7x).
# Source: Cloud TPU docs, "TPU VM" troubleshooting pages (device files held by a running process).
_TPU_DEVICE_GLOBS = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class TpuStatus:
    """What a TPU run would need, each piece checked separately so errors can name what is missing."""

    torch_tpu: str | None  # version of the torch-tpu distribution, if installed
    libtpu: str | None  # version of libtpu, if installed
    device_nodes: tuple[str, ...]  # TPU device files visible on this host

    @property
    def usable(self) -> bool:
        return bool(self.torch_tpu and self.libtpu and self.device_nodes)

    def missing(self) -> list[str]:
        out = []
        if not self.torch_tpu:
            out.append("torch_tpu is not installed (pip install 'tpurec[tpu]' on a TPU VM)")
        if not self.libtpu:
            out.append("libtpu is not installed (pip install libtpu)")
        if not self.device_nodes:
            out.append(
                "no TPU devices on this host (no /dev/accel* or /dev/vfio/N); "
                "run on a Cloud TPU VM, or use device='cpu' for a dry run with the CPU reference kernels"
            )
        return out


def tpu_status() -> TpuStatus:
    nodes: list[str] = []
    for pattern in _TPU_DEVICE_GLOBS:
        nodes.extend(sorted(glob.glob(pattern)))
    return TpuStatus(_installed("torch-tpu") or _installed("torch_tpu"), _installed("libtpu"), tuple(nodes))


def apply_safe_env() -> None:
    """Set TorchTPU's environment so that a CPU-only host neither aborts nor hangs.

    Only acts when torch_tpu is installed but this host has no TPU, and never overrides a value the
    user set. Has an effect only if torch was not imported yet (the autoload happens at import).
    """
    status = tpu_status()
    if status.torch_tpu and not status.device_nodes:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def kernel_backend() -> str:
    """Which embedding kernels would run: 'sparsecore' (TorchTPU ops) or 'cpu-reference'."""
    return "sparsecore" if tpu_status().usable else "cpu-reference"


class TpuUnavailableError(RuntimeError):
    pass


def resolve_device(device) -> "torch.device":  # noqa: F821
    """Turn "tpu", "tpu:0", "cpu", "meta" or a torch.device into a torch.device.

    "tpu" on a host without a usable TPU raises TpuUnavailableError at once, naming what is missing.
    """
    import torch

    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, idx = device.partition(":")
        index = int(idx) if idx else None
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if kind in ("cpu", "meta"):
        return torch.device(kind) if index is None else torch.device(kind, index)
    if kind in ("tpu", "privateuseone"):
        status = tpu_status()
        if not status.usable:
            raise TpuUnavailableError(
                "device='tpu' was requested but this host cannot run TPU kernels:\n  - "
                + "\n  - ".join(status.missing())
            )
        _load_torch_tpu()
        if index is None:
            index = torch.accelerator.current_device_index()
        return torch.device("tpu", index)
    raise ValueError(f"unsupported device {device!r}: use 'tpu', 'tpu:N', 'cpu' or a torch.device")


def _load_torch_tpu() -> None:
    # Imported only here, after tpu_status() saw torch_tpu, libtpu and device nodes.
    if "torch_tpu" not in sys.modules and importlib.util.find_spec("torch_tpu") is not None:
        import torch_tpu  # noqa: F401
