"""SIGTERM during work that leaves temporary files behind: raised as `Terminated` so the work's own
cleanup (`finally`, `except BaseException`) removes them before the process ends.

SIGTERM's default action ends a process at once, with no Python code run: `tpurec data synth` and
the synthetic dataset `tpurec train` makes left their temporary parts behind. Within
`unwinding_on_sigterm()` the first SIGTERM raises `Terminated`, a SystemExit whose code is 143
(128 + SIGTERM, what a shell reports for a process the signal ended); repeats are ignored while it
unwinds. Ctrl-C (SIGINT) is tpurec/interrupts.py's.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """SIGTERM arrived: unwinding, so cleanup runs, then exit 143."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)

    def __str__(self) -> str:
        return "stopped by SIGTERM (its temporary files removed)"


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeat must not cut the cleanup short
    raise Terminated()


@contextmanager
def unwinding_on_sigterm() -> Iterator[None]:
    """SIGTERM raises Terminated within the block (main thread only: elsewhere Python cannot handle
    signals, and the block runs as it is). The previous handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
