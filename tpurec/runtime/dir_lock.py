"""One writer per directory: an exclusive flock(2) on DIR/.lock, naming its holder to whoever else tries.

Two runs writing one checkpoint directory delete each other's step-N.tmp; two conversions into one
dataset directory both report success while one's files replace the other's. The lock is flock(2),
released by the kernel when the holder dies: no stale lock to clean up after a crash.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

LOCK = ".lock"


def lock_dir(root: str | os.PathLike, refuse: Callable[[str], Exception], program: str = "") -> TextIO:
    """Hold an exclusive lock on directory `root` (made if missing) until the returned file is
    closed (or removed with `unlock`) or this process ends. Held by another open file (another
    run): raise `refuse(holder)`, holder being "pid N" or "pid N, PROGRAM" as that run wrote it."""
    import fcntl

    path = Path(root) / LOCK
    Path(root).mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid, _, what = f.read().strip().partition("\n")
            f.close()
            raise refuse(f"pid {pid or '?'}" + (f", {what.strip()}" if what.strip() else "")) from None
        if _same_file(f, path):
            break
        f.close()  # locked a file `unlock` removed meanwhile: a third run may hold the new one
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n{program}\n" if program else f"{os.getpid()}\n")
    f.flush()
    return f


def unlock(held: TextIO) -> None:
    """Release a lock of `lock_dir` and remove its file (a directory written once keeps no trace)."""
    try:
        os.unlink(held.name)  # still locked: whoever opens the name from now on gets a new file
    except FileNotFoundError:
        pass
    held.close()


def _same_file(f: TextIO, path: Path) -> bool:
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
