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
            out.append("torch_tpu is not installed (on a TPU VM: .venv/bin/pip install -r requirements/tpu.txt)")
        if not self.libtpu:
            out.append("libtpu is not installed (on a TPU VM: .venv/bin/pip install -r requirements/tpu.txt)")
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


# TorchRec 1.9.2 calls torch.tpu.is_available() / current_stream() from torchrec.distributed.*;
# torch-tpu 0.2.0 treats those as "strict internal" device APIs and raises when a module outside
# torch/torch_tpu calls them, unless this variable is set when torch_tpu is imported
# (torch_tpu/_internal/device/_device_module.py reads it once, `_STRICT_INTERNAL_DEVICE_APIS`).
LEGACY_DEVICE_APIS_ENV = "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS"


def apply_safe_env() -> None:
    """Set TorchTPU's environment before torch loads it (torch_tpu autoloads at `import torch`).

    Where torch_tpu is installed: allow the device APIs TorchRec calls (LEGACY_DEVICE_APIS_ENV); on a
    host without a TPU also stop the autoload and the metadata-server query, so `import torch`
    neither aborts nor hangs. Never overrides a value the user set; has an effect only if torch was
    not imported yet, which `tpu_env_problems()` reports.
    """
    status = tpu_status()
    if status.torch_tpu:
        os.environ.setdefault(LEGACY_DEVICE_APIS_ENV, "1")
    if status.torch_tpu and not status.device_nodes:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def tpu_env_problems() -> list[str]:
    """What in this process's environment will break TorchRec on a TPU, one sentence each.

    torch_tpu reads LEGACY_DEVICE_APIS_ENV once, when it is imported; if that happened before tpurec
    could set it (torch imported first, or the variable set to 0), TorchRec's device calls raise.
    """
    if "torch_tpu" not in sys.modules or os.environ.get(LEGACY_DEVICE_APIS_ENV, "0") not in ("0", ""):
        return []
    return [
        f"torch_tpu was imported without {LEGACY_DEVICE_APIS_ENV}=1, so TorchRec's calls to torch.tpu "
        "device APIs will raise; import tpurec before torch, or export "
        f"{LEGACY_DEVICE_APIS_ENV}=1 before starting Python"
    ]


# TPU chips by PCI id (vendor 0x1ae0, Google), as torch-tpu 0.2.0 identifies them
# (torch_tpu/_internal/utils/hardware.py, `_PCI_DEVICE_ID_TO_NAME`). Reading sysfs initialises no
# TPU runtime, so it is safe at any time and from any process.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_PCI_CHIPS = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e", "0x0076": "v7x"}
# SparseCores per torch device, by generation: v5p 4, v6e 2, v7x 2 per device (2 devices per chip);
# v5e has none. Sources: jax-tpu-embedding NUM_SC_PER_DEVICE_MAP; Cloud TPU system-architecture pages
# for v5p, v6e and tpu7x. v4 has SparseCores, but neither TorchTPU's nor jax-tpu-embedding's public
# kernels drive them, so it counts as none here.
SPARSECORES_PER_DEVICE = {"v5p": 4, "v6e": 2, "v7x": 2, "v5e": 0, "v4": 0}


def tpu_generation(pci_root: str = "/sys/bus/pci/devices") -> str | None:
    """The TPU generation of this host's chips ("v5p", "v6e", ...) from PCI ids, or None."""
    try:
        entries = sorted(os.listdir(pci_root))
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(pci_root, entry, "vendor")) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(pci_root, entry, "device")) as f:
                chip = _PCI_CHIPS.get(f.read().strip())
        except OSError:
            continue
        if chip:
            return chip
    return None


def sparsecores_per_device(generation: str | None = None) -> int | None:
    """SparseCores the kernels will use per device on this host (None: not a TPU host we know).

    TorchTPU's SparseCore ops take no SparseCore count: the compiled kernel uses the chip's own, so a
    layout built for another count is silently wrong; this is the count every layout must use.
    """
    generation = generation or tpu_generation()
    return SPARSECORES_PER_DEVICE.get(generation) if generation else None


def kernel_backend() -> str:
    """Which embedding kernels would run: 'sparsecore' (TorchTPU ops) or 'cpu-reference'."""
    return "sparsecore" if tpu_status().usable else "cpu-reference"


class TpuUnavailableError(RuntimeError):
    pass


def resolve_device(device) -> torch.device:  # noqa: F821
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
