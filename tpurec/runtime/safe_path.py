"""Python processes tpurec starts never import code from the working directory.

`python -m MODULE` and `python -c CODE` put the working directory first on `sys.path`, so a file named
`json.py` or `torch.py` where the user happens to stand (a data or download directory) would run
inside torch.distributed.run's agent, every rank it starts, the `spawn` workers of `data convert
--jobs` (their `-c` bootstrap imports `pickle`, `socket`, `threading` before anything else) and the
benchmarks' children. Python 3.11's safe path (`-P`, or `PYTHONSAFEPATH` set in the environment)
leaves that entry out; the environment variable is what reaches the processes tpurec does not start
itself (torch.distributed.run's ranks, multiprocessing's workers and resource tracker), so every
launch here sets both.

A user's script (`tpurec launch prog.py`) still gets its own directory first on `sys.path`, as
`python prog.py` gives it (never the working directory): it runs through `tpurec.runtime.run_script`,
which also hands the program the caller's own `PYTHONSAFEPATH` back.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

ENV = "PYTHONSAFEPATH"
# The caller's own PYTHONSAFEPATH ("" when unset), for a user's program (`tpurec.runtime.run_script`).
CALLER_ENV = "TPUREC_CALLER_PYTHONSAFEPATH"


def python(*args: str) -> list[str]:
    """This interpreter started without the working directory on sys.path: `python -P ARGS`."""
    return [sys.executable, "-P", *args]


def env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child process (`base`, default this process's, plus `extra`) with
    PYTHONSAFEPATH=1, inherited by every Python process under it, and no empty PYTHONPATH entry (Python
    reads one as the working directory; `PYTHONPATH=$PYTHONPATH:dir` leaves one when it was unset)."""
    out = dict(os.environ if base is None else base, **extra)
    if "PYTHONPATH" in out:
        kept = [p for p in out["PYTHONPATH"].split(os.pathsep) if p]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del out["PYTHONPATH"]
    out.setdefault(CALLER_ENV, out.get(ENV, ""))  # a nested launch keeps the outermost caller's
    out[ENV] = "1"
    return out


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """While inside, Python processes this process starts without an explicit environment
    (multiprocessing's `spawn` workers and its resource tracker) get PYTHONSAFEPATH=1."""
    before = {k: os.environ.get(k) for k in (ENV, CALLER_ENV)}
    os.environ.update(env({k: v for k, v in before.items() if v is not None}))
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def script(path: str, *args: str) -> list[str]:
    """What a rank runs for a user's script `path`: `-m tpurec.runtime.run_script path ARGS`."""
    return ["-m", "tpurec.runtime.run_script", path, *args]


def restore_caller_env() -> bool:
    """In a user's program: put the caller's PYTHONSAFEPATH back; True when the caller had set it
    (the program then runs as `python -P prog.py` would: without its own directory on sys.path)."""
    caller = os.environ.pop(CALLER_ENV, None)
    if caller is not None:
        if caller:
            os.environ[ENV] = caller
        else:
            os.environ.pop(ENV, None)
    return bool(os.environ.get(ENV))
