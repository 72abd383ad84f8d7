"""Turn this process into an emulated TPU rank, and report what TorchTPU would have compiled.

Called once per rank, before the process group and the model exist (the Trainer does it when
`tpurec.runtime.device.emulated_slice()` names a slice). Refuses to run where the real torch_tpu is loaded.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from tpurec.emulation import torchtpu_dist, torchtpu_ops
from tpurec.errors import UserError
from tpurec.planner.topology import SliceSpec, parse_slice

# TorchTPU compiles a program per distinct compile key of its device ops; preprocessing runs on the host.
_DEVICE_OPS = "_sparse_dense_matmul"


@dataclass
class EmulatedRank:
    spec: SliceSpec
    local_rank: int
    ops: torchtpu_ops.StandIn
    # Program (op, compile key) -> (phase kind, the how-many-th phase of that kind first asked for it).
    first_seen: dict = field(default_factory=dict)
    _phase: tuple[str, int] = ("setup", 1)
    _counts: Counter = field(default_factory=Counter)
    _start: int = 0

    def begin(self, kind: str) -> None:
        """A training step ("train") or an evaluation pass ("eval") starts."""
        self._settle()
        self._counts[kind] += 1
        self._phase = (kind, self._counts[kind])

    def _settle(self) -> None:
        for call in self.ops.calls[self._start :]:
            if call[0].startswith(_DEVICE_OPS):
                self.first_seen.setdefault(call, self._phase)
        self._start = len(self.ops.calls)

    def programs_compiled(self) -> dict[str, int]:
        """Distinct TorchTPU programs per op: one per distinct compile key (shapes, dtypes, constants)."""
        self._settle()
        return dict(sorted(Counter(op for op, _ in self.first_seen).items()))

    def recompiles_after_warmup(self) -> int:
        """Programs first asked for after warm-up (the first training step, the first evaluation):
        on a TPU each would be a new XLA compilation in the middle of the run."""
        self._settle()
        return sum(1 for kind, n in self.first_seen.values() if kind != "setup" and n > 1)


_RANK: EmulatedRank | None = None


def _register_device_kernels() -> None:
    """The kernels tpurec registers for the TPU (its adapter onto TorchTPU's ops, its host routes for
    FBGEMM's KJT ops), as the emulated device's: called with device tensors, as on a TPU."""
    from tpurec.embedding import tpu
    from tpurec.emulation import device
    from tpurec.runtime import host_ops, torchrec_ops

    kernels = {op._qualname: kernel for op, kernel in tpu.kernels().items()}
    kernels.update(host_ops.kernels())
    kernels.update(torchrec_ops.kernels())
    device.register_kernels(kernels)


def current() -> EmulatedRank | None:
    return _RANK


def activate(slice_name: str | None = None) -> EmulatedRank:
    """Install TorchTPU's stand-ins in this process (idempotent) for a rank of `slice_name` (default:
    the slice the launcher named, `tpurec.runtime.device.emulated_slice()`)."""
    global _RANK
    from tpurec.runtime.device import EMULATE_ENV, emulated_slice

    name = slice_name or emulated_slice()
    if not name:
        raise RuntimeError(f"no slice to emulate: {EMULATE_ENV} is unset")
    if _RANK is not None:
        return _RANK
    spec = parse_slice(name)
    if not spec.generation.sparsecores:
        raise UserError(f"--emulate-tpu {name}: {spec.generation.name} has no SparseCore tpurec can drive")
    os.environ[EMULATE_ENV] = spec.name
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torchtpu_dist.install_device_module(local_rank, spec.devices_per_host)
    torchtpu_dist.register_backend()
    torchtpu_dist.refuse_ddp_shape_check_across_hosts(spec.hosts)
    torchtpu_dist.ddp_without_pinned_host_memory()
    ops = torchtpu_ops.install(sparsecores=spec.generation.sparsecores)
    _register_device_kernels()
    _RANK = EmulatedRank(spec, local_rank, ops)
    return _RANK
