"""Child processes that live and die with their parent (Linux).

`tpurec train --nproc N` runs torch.distributed.run as a child, and `data convert --jobs N` a pool of
workers. Without care, SIGTERM/Ctrl-C of the parent leaves them running (signals are not
forwarded), and a parent killed with SIGKILL leaves them waiting forever. Here: the child gets
SIGTERM from the kernel when its parent dies (PR_SET_PDEATHSIG), and the parent forwards SIGINT,
SIGTERM and SIGHUP to it and waits for it to stop.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from tpurec.runtime import safe_path

if TYPE_CHECKING:
    from types import FrameType

_PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (no-op off Linux).
    `parent`: the pid the parent had; if it is already gone (it died before this ran), exit now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:  # no glibc: best effort
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def run_child(cmd: list[str], env: dict | None = None) -> int:
    """Run `cmd` to completion, forwarding SIGINT/SIGTERM/SIGHUP to it; its exit code (128 + N
    when a signal N ended it, as a shell reports). Python under it starts without the working
    directory on sys.path (`tpurec.runtime.safe_path`)."""
    proc = subprocess.Popen(cmd, env=safe_path.env(env), preexec_fn=functools.partial(die_with_parent, os.getpid()))
    previous = {}

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
