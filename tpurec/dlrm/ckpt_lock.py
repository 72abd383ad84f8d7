"""One run per checkpoint directory: an exclusive flock(2) held by rank 0 for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

LOCK = ".lock"


class CheckpointDirInUse(ValueError):
    """Another run holds the checkpoint directory."""


def lock_dir(root):
    """Hold an exclusive lock on checkpoint directory `root` for the life of this process (or until
    the returned file is closed): two runs saving into one directory would delete each other's
    step-N.tmp and mix their checkpoints. Another run's lock: CheckpointDirInUse naming its pid.
    The lock is flock(2), released by the kernel when the process dies: no stale lock files."""
    import fcntl

    Path(root).mkdir(parents=True, exist_ok=True)
    f = open(Path(root) / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise CheckpointDirInUse(
            f"--checkpoint-dir {root} is in use by another run (pid {holder}); wait for it or give another directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
