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
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from tpurec.errors import UserError
from tpurec.runtime import env_flags

if TYPE_CHECKING:
    import torch  # imported where devices are made: detection needs no torch


# The compute devices tpurec trains and plans for: TorchRec's `compute_device` strings (Topology,
# ModuleSharder.sharding_types) that tpurec's kernel answers to. A torch.device's own `.type` stays a
# plain str ("meta", "cuda", ...), compared against these members where it is "cpu" or "tpu" (a
# StrEnum member equals its string), so the word is written once.
class DeviceKind(StrEnum):
    CPU = "cpu"
    TPU = "tpu"


# `tpurec train --device`: a kind, or "auto" (TPU when this host has a usable one).
DeviceChoice = Literal["auto", "cpu", "tpu"]

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

    def missing(self, cpu: str = "device='cpu'") -> list[str]:
        """What is missing, one sentence each; `cpu`: how the caller's user asks for the CPU instead
        (a command's `--device cpu`, a program's device='cpu')."""
        out = []
        if not self.torch_tpu:
            out.append("torch_tpu is not installed (on a TPU VM: .venv/bin/pip install -r requirements/tpu.txt)")
        if not self.libtpu:
            out.append("libtpu is not installed (on a TPU VM: .venv/bin/pip install -r requirements/tpu.txt)")
        if not self.device_nodes:
            out.append(
                "no TPU devices on this host (no /dev/accel* or /dev/vfio/N); "
                f"run on a Cloud TPU VM, or use {cpu} for a dry run with the CPU reference kernels"
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
# torch-tpu 0.2.0's handshake of compiled collective graphs across ranks (docs/tpu.md): unset is OFF,
# else COMPILE_STAGE or DISPATCH_STAGE (torch_tpu::GetHandshakeStageEnvVarOnce, read once).
HANDSHAKE_STAGE_ENV = "TORCH_TPU_SPMD_HANDSHAKE_STAGE"


def apply_safe_env() -> None:
    """Set TorchTPU's environment before torch loads it (torch_tpu autoloads at `import torch`).

    Where torch_tpu is installed: allow the device APIs TorchRec calls (LEGACY_DEVICE_APIS_ENV); on a
    host without a TPU also stop the autoload and the metadata-server query, so `import torch`
    neither aborts nor hangs. Never overrides a value the user set; has an effect only if torch was
    not imported yet, which `tpu_env_problems()` reports.
    """
    status = tpu_status()
    if status.torch_tpu or emulated_slice():  # an emulated rank's TorchTPU reads it too
        os.environ.setdefault(LEGACY_DEVICE_APIS_ENV, "1")
    if status.torch_tpu and not status.device_nodes:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    correct_legacy_device_apis()  # torch (and so torch_tpu) came first: the variable is too late


_CORRECTED = "_tpurec_corrected_legacy_apis"


def _unrestricted_device_apis(torch: Any) -> dict:  # the torch module
    """The device APIs TorchRec 1.9.2 calls on torch.tpu, answered without TorchTPU's strict wrappers.

    TorchTPU names torch.accelerator's functions as their replacements (`prefer=` in
    torch_tpu/_internal/device/_device_module.py). `current_stream` and `synchronize` there go to C++;
    `is_available` and `device_count` there ask torch.tpu again (they would recurse once torch.tpu's
    own are replaced), so those two read the accelerator hooks' device count in C++ directly.
    """
    return {
        "is_available": lambda: torch._C._accelerator_hooks_device_count() > 0,
        "device_count": lambda: torch._C._accelerator_hooks_device_count(),
        "current_stream": torch.accelerator.current_stream,
        "synchronize": torch.accelerator.synchronize,
    }


def _strict_device_apis() -> bool | None:
    """torch_tpu's own frozen flag (True: TorchRec's device calls raise), or None without torch_tpu.

    Read from `_STRICT_INTERNAL_DEVICE_APIS` in torch_tpu/_internal/device/_device_module.py, where
    torch_tpu stored it when it loaded; the environment variable may have been set since, to no effect.
    An emulated rank's torch.tpu carries the same attribute (tpurec/emulation/torchtpu_dist.py).
    """
    module = sys.modules.get("torch_tpu._internal.device._device_module")
    if module is None:
        torch = sys.modules.get("torch")
        module = getattr(torch, "tpu", None) if torch is not None else None
    flag = getattr(module, "_STRICT_INTERNAL_DEVICE_APIS", None) if module is not None else None
    return None if flag is None else bool(flag)


def correct_legacy_device_apis() -> bool:
    """Where torch_tpu loaded strict (torch was imported before tpurec and the variable was unset),
    point the torch.tpu device APIs TorchRec calls at their torch.accelerator equivalents, which
    TorchTPU names as the replacements and does not restrict. Returns whether anything was changed."""
    if not _strict_device_apis():
        return False
    torch = sys.modules.get("torch")
    module = getattr(torch, "tpu", None)
    if module is None or getattr(module, _CORRECTED, False):
        return False
    for legacy, unrestricted in _unrestricted_device_apis(torch).items():
        setattr(module, legacy, unrestricted)
    setattr(module, _CORRECTED, True)
    return True


def tpu_env_problems() -> list[str]:
    """What in this process's environment will break TorchRec on a TPU, one sentence each.

    torch_tpu freezes LEGACY_DEVICE_APIS_ENV when it loads (at `import torch` on a TPU VM); if that
    happened before tpurec could set it, TorchRec's device calls raise, unless
    `correct_legacy_device_apis()` has since routed them to torch.accelerator. Reads torch_tpu's own
    flag, never os.environ (which tpurec itself may have written after the fact).
    """
    if not _strict_device_apis():
        return []
    torch = sys.modules["torch"]
    if getattr(getattr(torch, "tpu", None), _CORRECTED, False):
        return []
    return [
        f"torch_tpu loaded without {LEGACY_DEVICE_APIS_ENV}=1 (torch was imported before tpurec), so TorchRec's "
        "calls to torch.tpu device APIs will raise; import tpurec before torch, export "
        f"{LEGACY_DEVICE_APIS_ENV}=1, or call tpurec.runtime.device.correct_legacy_device_apis()"
    ]


def name_tpu_backend(module: Any = None) -> None:  # torch_tpu's device module, when loaded
    """Name PrivateUse1 "tpu" on a host without TorchTPU, telling torch that no such device is present.

    TorchRec places shards on torch.device("tpu"), which parses only once PrivateUse1 has that name;
    offline planning and the emulation need it. Once named, torch asks PrivateUse1's hooks whether it
    is the build's accelerator (`dist.barrier()` calls `torch._C._get_accelerator()`, which raised
    "Please register PrivateUse1HooksInterface" without hooks), and its device module whether it is
    available (`torch.optim` steps ask), so both are registered, answering "no device". `module`, if
    given, becomes torch.tpu (replacing one tpurec installed before). A no-op where TorchTPU named it.
    """
    import types

    import torch

    class NoTpuHooks(torch._C._acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return False

        def has_primary_context(self, device_index: int) -> bool:
            return False

        def is_built(self) -> bool:
            return True

    current = torch._C._get_privateuse1_backend_name()
    if current == "privateuseone":
        torch.utils.rename_privateuse1_backend("tpu")
        torch._C._acc.register_python_privateuseone_hook(NoTpuHooks())
    elif current != DeviceKind.TPU:
        raise RuntimeError(f"PrivateUse1 backend is already named {current!r}; cannot use 'tpu'")
    elif "torch_tpu" in sys.modules:
        return
    if module is None and getattr(torch, "tpu", None) is not None:
        return
    if module is None:
        # torch.tpu without TorchTPU: no devices (the name exists for planning only).
        module = types.ModuleType("torch.tpu")
        module.is_available = lambda: False
        module.device_count = lambda: 0
    # Only the attribute, not sys.modules["torch.tpu"]: TorchTPU's loader skips building its module
    # when that name is already in sys.modules, and replaces an existing attribute.
    setattr(torch, "tpu", module)  # noqa: B010  (torch declares no such attribute)


# `tpurec train --emulate-tpu SLICE` runs every rank's TPU code path on this machine's CPU
# (tpurec/emulation); its launcher sets this variable, holding the slice's name, in each rank.
EMULATE_ENV = "TPUREC_EMULATE_TPU"


def emulated_slice() -> str | None:
    """The slice this process emulates a rank of ("v5p-16"), or None on a real host."""
    return env_flags.get(EMULATE_ENV) or None  # read per batch (tpu_path): the cheap read


def on_torchtpu(device: Any) -> bool:
    """Whether `device` (a torch.device) is a real TorchTPU one: a program there takes no host tensor
    as an argument ("expected tensor to be on tpu, got cpu", measured on a v5e: docs/tpu.md). The
    emulated device (type "tpu" too, without torch_tpu) takes host scalars as torch's CPU ops do."""
    return device is not None and device.type == "tpu" and "torch_tpu" in sys.modules


def resolve_choice(choice: DeviceChoice | DeviceKind) -> DeviceKind:
    """The kind a device choice names. "auto" (every command's default, a program's device=None) is
    the TPU when this process has one, a usable TPU or an emulated rank's, else the CPU: resolved here
    only, so `tpurec train`, `tpurec selftest` and DMP agree."""
    if choice == "auto":
        return DeviceKind.TPU if tpu_status().usable or emulated_slice() else DeviceKind.CPU
    return DeviceKind(choice)


def device_kind(device_type: str) -> DeviceKind:
    """The kind of work a torch device type runs: the TPU path for "tpu" and an emulated TPU rank's
    CPU (tpurec.emulation), else the CPU path."""
    return DeviceKind.TPU if tpu_path(device_type) else DeviceKind.CPU


def tpu_path(device_type: str) -> bool:
    """Whether tables on `device_type` take the TPU code path: a tpu device, or the CPU of an emulated
    TPU rank (fixed id limits, the chip's SparseCore count, float32 tables, TorchTPU's ops)."""
    return device_type == DeviceKind.TPU or (device_type == DeviceKind.CPU and emulated_slice() is not None)


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
    """The TPU generation of this host's chips ("v5p", "v6e", ...) from PCI ids, or None.

    An emulated rank's chip is its slice's generation (the launcher writes the slice's canonical name)."""
    emulated = emulated_slice()
    if emulated:
        return emulated.split("x", 1)[-1].split("-")[0] if emulated[0].isdigit() else emulated.split("-")[0]
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


def tensorcore_only(generation: str | None = None) -> bool:
    """Whether this TPU (or `generation`) is one tpurec drives with its TensorCore kernel: a chip
    whose SparseCores no public kernel drives (v5e has none; v4's are not driven)."""
    return sparsecores_per_device(generation) == 0


def kernel_backend() -> str:
    """Which embedding kernels would run: 'sparsecore' (TorchTPU's SparseCore ops), 'tensorcore'
    (tpurec's JAX programs through TorchTPU's JAX bridge, on v5e and v4) or 'cpu-reference'."""
    if not tpu_status().usable:
        return "cpu-reference"
    return "tensorcore" if tensorcore_only() else "sparsecore"


class TpuUnavailableError(UserError, RuntimeError):
    """This host cannot run TPU kernels (the message lists what is missing): the environment's
    fault, a user error. A RuntimeError too, as it was before UserError existed."""


def resolve_device(device: torch.device | str) -> torch.device:
    """Turn "tpu", "tpu:N", "cpu", "meta" or a torch.device into a torch.device ("tpu:N" is tpu:0).

    "tpu" on a host without a usable TPU raises TpuUnavailableError at once, naming what is missing.
    """
    import torch

    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, idx = device.partition(":")
        index = int(idx) if idx else None
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if kind in (DeviceKind.CPU, "meta"):
        return torch.device(kind) if index is None else torch.device(kind, index)
    if kind in (DeviceKind.TPU, "privateuseone"):
        if emulated_slice():
            # An emulated TPU rank: its device is tpu:0 (tpurec.emulation.device), as TorchTPU numbers a
            # process's own device; before the emulation is active (planning), the CPU.
            emulated_device = getattr(getattr(torch, "tpu", None), "_tpurec_emulated_device", False)
            return torch.device("tpu", 0) if emulated_device else torch.device("cpu")
        status = tpu_status()
        if not status.usable:
            raise TpuUnavailableError(
                "device='tpu' was requested but this host cannot run TPU kernels:\n  - "
                + "\n  - ".join(status.missing())
            )
        _load_torch_tpu()
        # One device per process, index 0, whatever index was asked: on a v5e chip TorchTPU 0.2.0 gave
        # `torch.ones(2, device="tpu:1").device` tpu:0 (docs/tpu.md). Kept, "tpu:1" reached DDP as
        # device_ids=[1].
        return torch.device("tpu", 0)
    raise UserError(f"unsupported device {device!r}: use 'tpu', 'tpu:N', 'cpu' or a torch.device")


def _load_torch_tpu() -> None:
    # Imported only here, after tpu_status() saw torch_tpu, libtpu and device nodes.
    if "torch_tpu" not in sys.modules and importlib.util.find_spec("torch_tpu") is not None:
        import torch_tpu  # noqa: F401
