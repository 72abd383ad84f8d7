"""tpurec: TorchRec on TPU.

Importing tpurec is cheap and never imports torch_tpu, libtpu or jax: everything TPU-specific is
loaded lazily, behind `tpurec.runtime.device`, only when a TPU is actually used.
"""

from typing import Any

from tpurec.runtime import device as _device

__version__ = "0.1.0"

# Must run before anything imports torch: a torch_tpu install on a host without a usable TPU would
# otherwise abort `import torch` or wait on the cloud metadata server (see docs/tpu.md).
_device.apply_safe_env()

if _device.emulated_slice():
    # A rank of an emulated TPU slice (`tpurec launch/train --emulate-tpu`): TorchTPU's stand-ins go in
    # before the program builds a process group or a model (tpurec.emulation).
    from tpurec.runtime.group_watch import quiet_interrupt_while_starting as _quiet

    with _quiet():  # a Ctrl-C of the launch during these imports (seconds): no traceback per rank
        from tpurec.emulation.rank import activate as _activate

        _activate()

__all__ = ["__version__", "DistributedModelParallel"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import tpurec` stays light; the DMP wrapper pulls in torchrec.distributed.
    if name == "DistributedModelParallel":
        from tpurec.sharding.dmp import DistributedModelParallel

        return DistributedModelParallel
    raise AttributeError(f"module 'tpurec' has no attribute {name!r}")
