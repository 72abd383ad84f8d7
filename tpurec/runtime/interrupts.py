"""Ctrl-C ends a tpurec command with one line saying what it left, exit 130 (128 + SIGINT, as a
shell reports), on every process of the job.

A terminal's Ctrl-C reaches every process of a job at once (the command, torch.distributed.run and
each rank, or `data convert`'s workers), and torch.distributed.run then passes it on to the ranks a
second time. Python's default turns each into a KeyboardInterrupt traceback wherever the process
happened to be: inside a checkpoint save, a collective, a worker's queue. Within `handled()` the
first SIGINT raises KeyboardInterrupt once; repeats within REPEAT_S are ignored while it unwinds
(later ones end the process at once: the user insists). The command's top level catches it and
prints its one line; work that knows what it leaves raises `Interrupted("what")` instead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

EXIT_INTERRUPTED = 128 + signal.SIGINT
REPEAT_S = 2.0  # a relayed SIGINT (torch.distributed.run's) arrives within milliseconds of the first


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt whose text says what the interrupted work left behind."""


_first: float | None = None  # when the first SIGINT of the current command arrived
_depth = 0  # nested handled() blocks
_deferring = 0  # nested deferred() blocks
_pending = False  # the first SIGINT arrived within deferred(): raised when it ends


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _first, _pending
    now = time.monotonic()
    if _first is None:
        _first = now
        if _deferring:
            _pending = True
            return
        raise KeyboardInterrupt
    if now - _first > REPEAT_S:
        os._exit(EXIT_INTERRUPTED)


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT handled as the module says for the block (in the main thread; elsewhere signals
    cannot be handled and the block runs as it is). Nested blocks share the outermost's state."""
    global _depth, _first, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _first, _pending = None, False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous)


@contextmanager
def deferred() -> Iterator[None]:
    """Within `handled()`, hold a Ctrl-C back for a few steps that must run together (renames that
    replace one complete checkpoint with another): its KeyboardInterrupt comes when they are done.
    (Blocking the signal would not do: the kernel hands it to another thread, and Python still runs
    the handler in the main thread.)"""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if _pending and not _deferring:
        _pending = False
        raise KeyboardInterrupt


def installed() -> bool:
    """This module's SIGINT handler is the one in place (inside `handled()`)."""
    return signal.getsignal(signal.SIGINT) is _on_sigint


def interrupted() -> bool:
    """A SIGINT has arrived in the current `handled()` command."""
    return _first is not None


def check() -> None:
    """Raise KeyboardInterrupt if a SIGINT has arrived: for an error that the interrupt caused
    (a library that wrapped the KeyboardInterrupt in its own error, a peer that left because it was
    interrupted), which is no error of its own."""
    if interrupted():
        raise KeyboardInterrupt


def line(program: str, error: KeyboardInterrupt) -> str:
    """The one line for `error`: `PROGRAM: interrupted`, and what was left when it says."""
    left = str(error) if isinstance(error, Interrupted) else ""
    return f"{program}: interrupted" + (f"; {left}" if left else "")
