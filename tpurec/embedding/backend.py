"""Which kernels run: the TPU adapter on a TPU device, the CPU reference everywhere else.

The choice follows the device the tables live on (the ops dispatch on it); this module resolves the
user's device argument and, for a TPU device only, loads the adapter that registers the TPU kernels.
"""

from __future__ import annotations

import torch

from tpurec.runtime import device as _device

_tpu_loaded = False


def load_tpu_backend() -> None:
    """Register the TPU kernels of torch.ops.tpurec.* (idempotent). Needs a usable TPU host."""
    global _tpu_loaded
    if _tpu_loaded:
        return
    from tpurec.embedding import tpu  # imported here only: it is never needed on a CPU-only host
    from tpurec.runtime import host_ops, torchrec_ops

    _device.correct_legacy_device_apis()  # torch came before tpurec: TorchRec's device calls would raise
    from tpurec.embedding.kernel_kinds import device_kernels

    tpu.register(device_kernels())  # this chip's kind: SparseCore ops, or the TensorCore kernel
    host_ops.register()  # FBGEMM KJT ops TorchRec runs on the device: route them through the host
    torchrec_ops.register()  # torchrec::permute_pooled_embs (column-wise outputs) with aten kernels on the device
    _tpu_loaded = True


def select_device(device: torch.device | str | None) -> torch.device:
    """None means "auto": a TPU if this process has one, else the CPU (`resolve_choice`)."""
    if device is None:
        device = _device.resolve_choice("auto")
    resolved = _device.resolve_device(device)
    if resolved.type not in (_device.DeviceKind.CPU, "meta"):
        load_tpu_backend()
    return resolved
