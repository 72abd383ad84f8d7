"""Ops TorchTPU 0.2.0 lacks, found in a CPU run of the user's code (issue 63 item 2, before any rank starts).

The emulated device (device.py) names such an op when a rank's step reaches it: after the ranks
started, built their data and model, and ran to step 1. `MissingOpTrace` sees the same ops on plain
CPU tensors: a dispatch mode, run around one forward in the launcher, that raises the emulated
device's one line (missing_op.py) at the first op of the user's code TorchTPU has no kernel for.
It lives in the emulation package because missing_op reads frames of this package as the device's,
not as tpurec's own calls (which it leaves to TorchTPU's own error).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


@cache
def missing_ops() -> frozenset[str]:
    """TorchTPU 0.2.0's missing ops (torchtpu_kernels.json, `fallback_ops`) less those tpurec serves on
    the device itself (its host routes for FBGEMM's KJT ops, its `torchrec::` kernels), as
    `device.missing_kernel` decides on an emulated rank."""
    from tpurec.emulation.device import torchtpu_fallback_ops
    from tpurec.runtime import host_ops, torchrec_ops

    routed = set(host_ops.kernels()) | set(torchrec_ops.kernels())
    return frozenset(torchtpu_fallback_ops() - routed)


class MissingOpTrace(TorchDispatchMode):
    """Raises `missing_op.MissingTpuKernel` for the first op TorchTPU lacks that the user's code
    calls; ops tpurec's own code calls run on (on a TPU, tpurec routes or shards them)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.name() in missing_ops():
            from tpurec.emulation import missing_op

            found = missing_op.error(func.name(), "")
            if isinstance(found, missing_op.MissingTpuKernel):
                raise found
        return func(*args, **(kwargs or {}))
