"""SIGTERM during work that leaves temporary files behind: raised as `Terminated` so the work's own
cleanup (`finally`, `except BaseException`) removes them before the process ends.

SIGTERM's default action ends a process at once, with no Python code run: `tpurec data synth` and
the synthetic dataset `tpurec train` makes left their temporary parts behind. Within
`unwinding_on_sigterm()` the first SIGTERM raises `Terminated`, a SystemExit whose code is 143
(128 + SIGTERM, what a shell reports for a process the signal ended); repeats are ignored while it
unwinds. Ctrl-C (SIGINT) is tpurec/runtime/interrupts.py's.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """SIGTERM arrived: unwinding, so cleanup runs, then exit 143. `left` says what the work left
    (re-raised by the work's cleanup with its own words)."""

    def __init__(self, left: str = "its temporary files removed") -> None:
        super().__init__(EXIT_TERMINATED)
        self.left = left

    def __str__(self) -> str:
        return f"stopped by SIGTERM; {self.left}"


_depth = 0  # nested unwinding_on_sigterm() blocks: the outermost says the one line


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeat must not cut the cleanup short
    raise Terminated()


@contextmanager
def unwinding_on_sigterm(program: str | None = None) -> Iterator[None]:
    """SIGTERM raises Terminated within the block (main thread only: elsewhere Python cannot handle
    signals, and the block runs as it is). The previous handler is back afterwards. With `program`,
    the outermost block prints one line on stderr as the Terminated leaves it:
    `PROGRAM: stopped by SIGTERM; <what was left>`."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _depth += 1
    try:
        yield
    except Terminated as e:
        if program and _depth == 1:
            print(f"{program}: {e}", file=sys.stderr)
        raise
    finally:
        _depth -= 1
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
