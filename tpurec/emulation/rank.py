"""Turn this process into an emulated TPU rank, and report what TorchTPU would have compiled.

Called once per rank, before the process group and the model exist (the Trainer does it when
`tpurec.runtime.device.emulated_slice()` names a slice). Refuses to run where the real torch_tpu is loaded.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tpurec.emulation import compiled, device, handshake, torchtpu_dist, torchtpu_ops
from tpurec.planner.topology import SliceSpec, parse_slice


@dataclass
class EmulatedRank:
    spec: SliceSpec
    local_rank: int
    ops: torchtpu_ops.StandIn
    _counts: Counter = field(default_factory=Counter)
    _marked: bool = False  # the program marks its own steps (begin): DMP forwards do not

    def begin(self, kind: str) -> None:
        """A training step ("train") or an evaluation pass ("eval") starts: the device's ops from here
        on belong to it."""
        self._marked = True
        self._begin(kind)

    def _begin(self, kind: str) -> None:
        self._counts[kind] += 1
        device.RECORD.phase = (kind, self._counts[kind])

    def dmp_forward(self, kind: str) -> None:
        """A forward of tpurec's DMP (tpurec.runtime.run_report): a step of a program that does not
        mark its own."""
        if not self._marked:
            self._begin(kind)

    def figures(self) -> dict[str, Any]:
        """What `tpurec train` reports of an emulated rank, for any program (tpurec.runtime.run_report):
        programs compiled, those first compiled after warm-up, and every device->host copy in the
        training steps after warm-up, per step (the warm-up's apart)."""
        copies = self.train_copies()
        steady = max(0, self._counts["train"] - device.WARMUP["train"])
        return {
            "emulated_tpu": self.spec.name,
            "programs_compiled": self.programs_compiled(),
            "recompiles_after_warmup": self.recompiles_after_warmup(),
            "recompiled_ops": dict(Counter(op for _, op, _ in self.late_programs()).most_common(10)),
            "device_to_host_copies_per_step": round(sum(copies.values()) / max(1, steady), 4),
            "device_to_host_copies": copies,
            "device_to_host_copies_in_warmup": self.train_copies(steady=False),
            **self.graph_counts(),
        }

    def graph_counts(self) -> dict[str, Any]:
        """`graphs_compiled` and `graph_breaks`: what torch.compile traced in this process (`compiled.py`);
        with a handshake stage set, how many of its collective graphs the ranks agreed on (`handshake.py`)."""
        return {**compiled.graph_counts(), **handshake.figures()}

    def programs_compiled(self) -> dict[str, Any]:
        """Distinct TorchTPU programs, one per distinct (op, compile key) asked of the device: SparseCore
        programs by op, TensorCore, collective and compiled-graph programs (`compiled.py`) counted."""
        by_kind: Counter = Counter(kind for kind, _, _ in device.RECORD.programs)
        sparsecore = Counter(op for kind, op, _ in device.RECORD.programs if kind == "sparsecore")
        return {
            "sparsecore": dict(sorted(sparsecore.items())),
            "tensorcore": by_kind["tensorcore"],
            "collective": by_kind["collective"],
            "compiled": by_kind["compiled"],
        }

    def recompiles_after_warmup(self) -> int:
        """Programs of any kind first asked for after warm-up: on a TPU each would be a new XLA
        compilation in the middle of the run."""
        return len(self.late_programs())

    def late_programs(self) -> list[tuple[str, str, Any]]:
        """(kind, op, compile key) of each program first asked for after warm-up (`device.WARMUP`)."""
        return [program for program, phase in device.RECORD.programs.items() if device.after_warmup(phase)]

    def train_copies(self, steady: bool = True) -> dict[str, int]:
        """Device->host copies made during training steps after warm-up (`steady`) or in it, by call
        site ("tpurec.dlrm.trainer._read_loss")."""
        found = device.RECORD.to_host_by_phase.items()
        return {site: n for (kind, late, site), n in sorted(found) if kind == "train" and late == steady}


_RANK: EmulatedRank | None = None


def _register_device_kernels() -> None:
    """The kernels tpurec registers for the TPU (its adapter onto TorchTPU's ops, its host routes for
    FBGEMM's KJT ops), as the emulated device's: called with device tensors, as on a TPU."""
    from tpurec.embedding.kernel_kinds import device_kernels
    from tpurec.emulation import device
    from tpurec.runtime import host_ops, torchrec_ops

    kernels = {op._qualname: kernel for op, kernel in device_kernels().items()}
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
    os.environ[EMULATE_ENV] = spec.name
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torchtpu_dist.install_device_module(local_rank, spec.devices_per_host)
    device.set_generation(spec.generation.name)  # the ops its chip aborts on are refused
    torchtpu_dist.register_backend()
    torchtpu_dist.refuse_ddp_shape_check_across_hosts(spec.hosts)
    torchtpu_dist.ddp_without_pinned_host_memory()
    # no SparseCores (v5e, v4): the TensorCore kernel's TPU kernels run through the JAX-bridge stand-in
    ops = torchtpu_ops.install(sparsecores=max(1, spec.generation.sparsecores))
    if not spec.generation.sparsecores:
        from tpurec.embedding.tensorcore import tpu_bridge
        from tpurec.emulation import jax_bridge

        tpu_bridge.use_jax_op(jax_bridge.jax_op)
    compiled.register_backend()
    _register_device_kernels()
    _RANK = EmulatedRank(spec, local_rank, ops)
    from tpurec.runtime import run_report

    run_report.on_step(_RANK.dmp_forward)  # the steps of a program that does not mark them
    run_report.provide(_RANK.figures)  # `tpurec launch`'s end-of-run line
    return _RANK
