"""What an emulated TPU rank does differently from a real one, behind one object.

A rank of `tpurec train --emulate-tpu` runs on TorchTPU's stand-ins (`tpurec.emulation.rank`): its
tables live in this host's memory, the device marks the phase (training, evaluation) each program and
copy belongs to, a loss read by the host is a copy off the device, and the result line carries what
the stand-ins measured (programs compiled, recompiles, copies by call site). The trainer asks its
`Emulation` at each of those points: a real rank's does nothing and measures nothing (`Emulation`);
an emulated one's (`EmulatedSlice`) does and reports. `start()` picks the one this process runs.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    import torch

    from tpurec.emulation.rank import EmulatedRank


class Emulation:
    """A real rank (a CPU's, a TPU's): nothing emulated."""

    topology: str | None = None  # the emulated slice's name (a limits file's "topology")

    def begin(self, phase: str) -> None:
        """A training step or an evaluation starts (`phase`: "train" or "eval")."""

    def loss_on_device(self, loss: torch.Tensor) -> None:
        """The loss the host is about to read: computed on the device."""

    def tables_in_host_memory(self, device: DeviceKind) -> bool:
        """Whether this rank's tables take this host's memory (checked before the data is read)."""
        return device == DeviceKind.CPU

    def compile_figures(self, device: DeviceKind) -> dict[str, Any]:
        """The result line's figures of what the device compiled; on a real TPU, unknown (TorchTPU
        0.2.0 exposes no count tpurec reads yet)."""
        return {"programs_compiled": None, "recompiles_after_warmup": None} if device == DeviceKind.TPU else {}

    def train_copies(self, counted: Counter, steps_run: int) -> tuple[Counter, int, dict[str, int] | None]:
        """The device->host copies of the training steps to report, the steps they span, and those
        of the warm-up (None: not told apart): tpurec's own counts (tpurec.runtime.host_copies)."""
        return counted, steps_run, None


class EmulatedSlice(Emulation):
    """A rank of an emulated TPU slice (tpurec.emulation.rank.EmulatedRank)."""

    def __init__(self, rank: EmulatedRank) -> None:
        self.rank = rank
        self.topology = rank.spec.name

    def begin(self, phase: str) -> None:
        self.rank.begin(phase)

    def loss_on_device(self, loss: torch.Tensor) -> None:
        from tpurec.runtime import host_copies

        host_copies.mark_on_device(loss)  # a real rank computes the loss on its TPU

    def tables_in_host_memory(self, device: DeviceKind) -> bool:
        return True  # the emulated TPU's memory is this host's

    def compile_figures(self, device: DeviceKind) -> dict[str, Any]:
        from tpurec.sharding.tpu_all_to_all import padded_calls

        rank = self.rank
        return dict(
            emulated_tpu=rank.spec.name,
            padded_all_to_alls=padded_calls(),
            programs_compiled=rank.programs_compiled(),
            recompiles_after_warmup=rank.recompiles_after_warmup(),
            # Which ops recompiled, and how often: where a shape followed the data.
            recompiled_ops=dict(Counter(op for _, op, _ in rank.late_programs()).most_common(10)),
            **rank.graph_counts(),  # torch.compile graphs and graph breaks (0: an eager step)
        )

    def train_copies(self, counted: Counter, steps_run: int) -> tuple[Counter, int, dict[str, int] | None]:
        # Every copy off the emulated device (tpurec.emulation.device), by call site, in the steps
        # after warm-up; the warm-up's own (DDP's bucket rebuild in step 2) apart.
        return Counter(self.rank.train_copies()), max(0, steps_run - 2), self.rank.train_copies(steady=False)


def start() -> Emulation:
    """This process's: an emulated slice's rank (`tpurec train --emulate-tpu`: TorchTPU's stand-ins
    installed now, before anything else touches the device), else a real rank's."""
    from tpurec.runtime.device import emulated_slice

    if not emulated_slice():
        return Emulation()
    from tpurec.emulation.rank import activate

    return EmulatedSlice(activate())
