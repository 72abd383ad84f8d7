"""A default process group tpurec starts is destroyed when the interpreter exits normally.

Without `destroy_process_group()`, gloo's C++ worker threads can still hold work objects with
tensors in them when Python finalizes; freeing those then takes the GIL of a dying interpreter and
the process aborts ("terminate called without an active exception", SIGABRT) after the program's
last line: pytorch/pytorch#190489, and the abandoned fix pytorch/pytorch#179291 (an atexit handler
in init_process_group, the same idea). It struck `examples/quickstart.py` at 2 ranks in CI, which
joins its ranks through `tpurec.DistributedModelParallel` and never destroys the group. So
whatever tpurec initializes, it also tears down at exit, unless the program already did, or is
exiting on an unhandled exception (destroying a group while other ranks may still be in a
collective can hang them; the failure is already reported then).

Destroying is not enough while a model (a DMP's sharding env) still holds the group: gloo's worker
threads live on, and one that frees a finished collective's tensors after the interpreter began
finalizing aborts the process (the cause, found in a core dump: tpurec/runtime/rank_exit.py). The
ranks tpurec launches therefore end without finalizing (`rank_exit.run_and_exit`); for a program run
under a plain torchrun this handler also lets go of the GIL for a moment, so a worker still freeing
the last collective's tensors does it while the interpreter is whole (narrows the window; only
`os._exit` closes it).
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any

import torch.distributed as dist

_registered = False


def init(backend: str, **kwargs: Any) -> None:
    """`dist.init_process_group(backend, **kwargs)`, destroyed again at normal exit."""
    global _registered
    dist.init_process_group(backend, **kwargs)
    if not _registered:
        atexit.register(_destroy_at_exit)
        _registered = True


def _destroy_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # exiting on an unhandled exception
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(0.05)  # the GIL released: a gloo worker freeing Python tensors finishes now
