"""One run per checkpoint directory: an exclusive flock(2) held by rank 0 for the whole run."""

from __future__ import annotations

import os
from typing import TextIO

from tpurec.errors import UserError
from tpurec.runtime.dir_lock import LOCK
from tpurec.runtime.dir_lock import lock_dir as _lock_dir

__all__ = ["LOCK", "CheckpointDirInUse", "lock_dir"]


class CheckpointDirInUse(UserError):
    """Another run holds the checkpoint directory."""


def lock_dir(root: str | os.PathLike) -> TextIO:
    """Hold an exclusive lock on checkpoint directory `root` for the life of this process (or until
    the returned file is closed): two runs saving into one directory would delete each other's
    step-N.tmp and mix their checkpoints. Another run's lock: CheckpointDirInUse naming its pid."""
    return _lock_dir(
        root,
        lambda holder: CheckpointDirInUse(
            f"--checkpoint-dir {root} is in use by another run ({holder}); wait for it or give another directory"
        ),
    )
