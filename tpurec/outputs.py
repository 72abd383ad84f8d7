"""Where a command will write, checked before it does any work.

A metrics file, saved plan or dataset directory that cannot be written used to fail only when it
was written: after minutes of training or planning, with a traceback. Each command checks its
outputs first and refuses in one line naming the flag (or variable), the path and why.

Writability is probed with a real file, not os.access: root passes every permission check but not
a read-only mount.

Every file a command outputs is then written by `write_atomic`: whole or not at all (a temporary file
in the same directory, renamed over the target), its size checked against the free space first, and a
failed write is one line naming the path. A full disk used to leave an empty or half-written
metrics file, plan or limits file behind, and a traceback that named no path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
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


def _uri_scheme(path: str | os.PathLike) -> str | None:
    """The scheme of a URI (``s3`` of ``s3://b/k``), else None."""
    text = os.fspath(path)
    scheme, sep, _ = text.partition("://") if isinstance(text, str) else ("", "", "")
    return scheme if sep and scheme[:1].isalpha() and all(c.isalnum() or c in "+.-" for c in scheme) else None


def file_problem(path: str | os.PathLike, makes_parents: bool = False) -> str | None:
    """Why a file cannot be written (created or replaced) at `path`, else None. Its directory must
    exist unless the writer makes it (`makes_parents`). A URI is refused: these files are written to
    local paths only, and `s3://b/m.csv` would land in a local directory `s3:` while the command
    printed "wrote s3://b/m.csv" (datasets and checkpoints, not files, go to buckets)."""
    scheme = _uri_scheme(path)
    if scheme:
        return (
            f"a {scheme}:// URI; this file is written to a local path only (it would land in a local "
            f"directory '{scheme}:'): write it locally and copy it to the bucket"
        )
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


def _named(flag: str | None, path: str | os.PathLike) -> str:
    return f"{flag}={path}" if flag and flag.isupper() else f"{flag} {path}" if flag else str(path)


def write_atomic(
    path: str | os.PathLike, data: str | bytes, flag: str | None = None, makes_parents: bool = False
) -> None:
    """Write `data` (text as UTF-8) to `path` whole or not at all: into a temporary file beside it,
    flushed to disk, then renamed over it, so a reader (or a crash, or a full disk) never meets a
    partial file and a file there before stays as it was. UserError in one line naming `flag` and
    the path when it cannot be written (the free space is too small for `data`, or the write fails),
    with no temporary file left. `makes_parents` creates missing directories first."""
    blob = data.encode() if isinstance(data, str) else data
    uri = file_problem(path) if _uri_scheme(path) else None
    if uri:  # a caller that did not check its outputs first: still never a local "s3:" directory
        raise UserError(f"{_named(flag, path)}: {uri}")
    full = os.path.realpath(path)  # through a symlink: the file it names is replaced, the link stays
    if os.path.exists(full) and not stat.S_ISREG(os.stat(full).st_mode):
        # a device or a pipe (`--out /dev/stdout`, a FIFO): nothing to rename over, and renaming
        # would replace the device node itself; written straight through
        try:
            with open(full, "wb") as f:
                f.write(blob)
        except OSError as e:
            raise UserError(f"{_named(flag, path)}: could not write it ({e.strerror or e})") from None
        return
    where = os.path.dirname(full)
    free = free_disk_bytes(where)
    if free is not None and free < len(blob):
        raise UserError(f"{_named(flag, path)}: {len(blob):,} bytes to write, but only {free:,} free there")
    tmp = os.path.join(where, f".{os.path.basename(full)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if makes_parents:
            os.makedirs(where, exist_ok=True)
        # 0o666 less the umask, as open(path, "w") makes a new file; a file replaced keeps its mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename makes it the file
            try:
                os.chmod(tmp, stat.S_IMODE(os.stat(full).st_mode))
            except FileNotFoundError:
                pass
            os.replace(tmp, full)
        finally:
            with contextlib.suppress(OSError):  # gone once renamed; else never left behind
                os.unlink(tmp)
    except OSError as e:
        why = (e.strerror or os.strerror(e.errno)) if e.errno else str(e)
        raise UserError(f"{_named(flag, path)}: could not write it ({why})") from None


def free_disk_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem `path` is on (or would be created on: its nearest existing
    parent), for this user (shutil.disk_usage); None if it cannot be read."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None
