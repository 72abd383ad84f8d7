"""A SIGTERM or Ctrl-C during training asks the loop to stop at a step every rank agrees on, so the
run can write a final checkpoint, its metrics and curves, and say how to resume.

A preempted spot TPU VM, a maintenance event or a scheduler's kill sends SIGTERM (GCE gives about
30 s before the VM stops; torch.distributed.run gives its ranks 30 s before SIGKILL); a user's
Ctrl-C reaches every process of the job. Raising at once (tpurec/runtime/interrupts.py, terminate.py)
unwinds each rank wherever it happens to be, mid-collective, and nothing can be saved consistently.
Within `catching()` (the trainer's training segments; SIGTERM alone through its evaluations and
saves) the first SIGTERM or SIGINT only records the signal; the training loop asks `agreed()` at its
log steps and after each evaluation and save (the same points on every rank), which takes the
maximum over the ranks, so a signal that reached one rank stops them all at the same step.
Repeats are ignored while the run stops (torch.distributed.run relays the signal), except a Ctrl-C
more than `interrupts.REPEAT_S` after the first: the user insists, and the process ends at once
(exit 130).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tpurec.runtime import interrupts
from tpurec.runtime.terminate import EXIT_TERMINATED

if TYPE_CHECKING:
    from types import FrameType

NAMES = {int(signal.SIGTERM): "SIGTERM", int(signal.SIGINT): "Ctrl-C"}
EXIT_CODES = {int(signal.SIGTERM): EXIT_TERMINATED, int(signal.SIGINT): interrupts.EXIT_INTERRUPTED}


class StoppedBySignal(SystemExit):
    """Training stopped at an agreed step for a signal; its text is the run's last line (rank 0)."""

    def __init__(self, signum: int, step: int, saved: object | None, resume: str) -> None:
        super().__init__(EXIT_CODES.get(signum, EXIT_TERMINATED))
        what = NAMES.get(signum, f"signal {signum}")
        if saved is not None:
            self.text = f"stopped by {what} at step {step}; checkpoint {saved} written; resume with: {resume}"
        else:
            self.text = f"stopped by {what} at step {step}; nothing saved (no --checkpoint-dir)"

    def __str__(self) -> str:
        return self.text


class StopRequest:
    """The signal that asked the run to stop (0: none yet) and when it came."""

    def __init__(self) -> None:
        self.signum = 0
        self._at = 0.0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum, self._at = signum, time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self._at > interrupts.REPEAT_S:
            os._exit(interrupts.EXIT_INTERRUPTED)  # a second, deliberate Ctrl-C: stop now

    def agreed(self, world_size: int) -> int:
        """The signal every rank stops for (0: go on). Collective when world_size > 1: every rank
        calls it at the same step."""
        if world_size <= 1:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def installed() -> bool:
    """A StopRequest's handler is the SIGINT handler in place (inside `catching()`)."""
    handler = signal.getsignal(signal.SIGINT)
    return isinstance(getattr(handler, "__self__", None), StopRequest)


TRAINING = (signal.SIGTERM, signal.SIGINT)  # what a training segment records
PREEMPTION = (signal.SIGTERM,)  # what the rest of a run records: Ctrl-C there stays interrupts.py's


@contextmanager
def catching(request: StopRequest, signals: tuple[signal.Signals, ...] = TRAINING) -> Iterator[StopRequest]:
    """`signals` recorded in `request` for the block (main thread only: elsewhere signals cannot be
    handled and the request never fires). The previous handlers are back afterwards. The trainer
    records both while it trains, and SIGTERM alone (PREEMPTION) through its evaluations and saves:
    a preempted VM's save finishes and the run stops after it with that checkpoint, where the
    default action would end the process mid-save with no line. A Ctrl-C during a save or an
    evaluation still interrupts it at once (tpurec/runtime/interrupts.py names the last complete
    checkpoint): the user at the terminal asked to stop now."""
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._on_signal) for s in signals}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
