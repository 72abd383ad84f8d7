"""Where a command will write, checked before it does any work.

A metrics file, saved plan or dataset directory that cannot be written used to fail only when it
was written: after minutes of training or planning, with a traceback. Each command checks its
outputs first and refuses in one line naming the flag (or variable), the path and why.

Writability is probed with a real file, not os.access: root passes every permission check but not
a read-only mount.
"""

from __future__ import annotations

import os
import tempfile

from tpurec.errors import UserError


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be created in directory `path` (or, if it does not exist yet, in the
    nearest existing directory above it, where it would be made), else None."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".tpurec-write-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return f"cannot write in {probe} ({e.strerror or e})"
    return None


def file_problem(path: str | os.PathLike, makes_parents: bool = False) -> str | None:
    """Why a file cannot be written (created or replaced) at `path`, else None. Its directory must
    exist unless the writer makes it (`makes_parents`)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{path} is a directory"
    parent = os.path.dirname(full)
    if not makes_parents and not os.path.exists(parent):
        return f"cannot write into {parent}: no such directory"
    return dir_problem(parent)


# what a command writes: a directory (made if missing), a file in an existing directory, or a file
# whose directories the writer makes
KINDS = {"dir": dir_problem, "file": file_problem, "file+dirs": lambda p: file_problem(p, makes_parents=True)}


def output_problem(flag: str, path: str | os.PathLike | None, kind: str = "file") -> str | None:
    """`FLAG PATH: why` when output `path` of `kind` (KINDS) cannot be written; None when it can
    or when no path is given."""
    if path is None:
        return None
    problem = KINDS[kind](path)
    if problem is None:
        return None
    # an environment variable reads as NAME=VALUE, a flag as it is typed
    return f"{flag}={path}: {problem}" if flag.isupper() else f"{flag} {path}: {problem}"


def check_outputs(outputs: list[tuple[str, str | os.PathLike | None, str]]) -> None:
    """UserError (one line) for the first of (flag, path, kind) that cannot be written."""
    for flag, path, kind in outputs:
        problem = output_problem(flag, path, kind)
        if problem:
            raise UserError(problem)
