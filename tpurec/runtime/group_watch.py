"""A rank that leaves before the process group forms, noticed by the launcher (issue #43).

torch.distributed.run counts a rank that exits 0 as done, and `init_process_group` waits for every
rank of the world: when one rank of a `tpurec launch` program ends early (a rank-conditional early
return, a misread flag), the others wait in `init_process_group` for up to its 30-minute default
while nothing is printed. Each rank of a user's program (`tpurec.runtime.run_script`) records how far
it got in a file of a directory the launcher made (`WATCH_ENV`): `joining` while inside
`init_process_group`, `formed` once it returned, `left CODE` when the program ended before that. The
launcher (`tpurec.launch.hosts.run_hosts`) reads them while it waits and stops the run in one
line naming the rank that left while others wait for it.

The same directory is the run's for the ranks' one-line errors (`error-R`, `tpurec.runtime.rank_errors`),
which the launcher prints once each when the ranks have ended.

Only exit code 0 needs this: a rank that fails (non-zero) is already noticed by torch.distributed.run,
which stops the others. A group formed another way than `init_process_group` (a library holding the
function from before the program started) records nothing; the watch then never fires.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

WATCH_ENV = "TPUREC_GROUP_WATCH_DIR"

_state = {"formed": False}


def _record(text: str) -> None:
    where, rank = os.environ.get(WATCH_ENV), os.environ.get("RANK")
    if not where or rank is None:
        return
    path = os.path.join(where, f"rank-{rank}")
    try:  # whole or not at all: the launcher may read it at any moment
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher gone or its directory removed: nobody to tell


@contextlib.contextmanager
def quiet_interrupt_while_starting() -> Iterator[None]:
    """In a rank a tpurec launcher started (WATCH_ENV set): a SIGINT while the rank starts (importing
    torch and TorchRec takes seconds) ends it at once with exit 130 and no KeyboardInterrupt traceback
    out of the middle of an import; the launcher says in one line that the run was interrupted."""
    if not os.environ.get(WATCH_ENV) or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: os._exit(128 + signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def watch_group_forming() -> None:
    """In a rank of a user's program, before it runs: record entering and leaving
    init_process_group. Does nothing outside a launch that watches (no WATCH_ENV)."""
    if not os.environ.get(WATCH_ENV):
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        _record("joining")
        out = original(*args, **kwargs)
        _state["formed"] = True
        _record("formed")
        return out

    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def program_ended(code: int) -> None:
    """The program ended with exit `code`; recorded when its process group never formed."""
    if not _state["formed"]:
        _record(f"left {code}")


def exit_code(e: SystemExit) -> int:
    """The process exit code a SystemExit makes (None 0, an int itself, anything else 1: printed)."""
    return 0 if e.code is None else e.code if isinstance(e.code, int) else 1


def early_exit(where: str) -> tuple[list[int], list[int]]:
    """(ranks that ended with code 0 before the group formed, ranks waiting in init_process_group),
    from the records in `where`; the run hangs when both are non-empty."""
    left, waiting = [], []
    try:
        names = os.listdir(where)
    except OSError:
        return [], []
    for name in names:
        if not name.startswith("rank-") or name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(where, name)) as f:
                text = f.read()
            rank = int(name[5:])
        except (OSError, ValueError):
            continue
        if text == "left 0":
            left.append(rank)
        elif text == "joining":
            waiting.append(rank)
    return sorted(left), sorted(waiting)


def describe(left: list[int], waiting: list[int]) -> str:
    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    return (
        f"{ranks(left)} exited with code 0 before the process group formed, while {ranks(waiting)} "
        f"waited for {'them' if len(left) > 1 else 'it'} in init_process_group; stopped the run"
    )
