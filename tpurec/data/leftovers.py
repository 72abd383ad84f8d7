"""Temporary files a killed writer left behind, found and removed by the next writer.

SIGTERM and Ctrl-C unwind and remove a run's temporary files (tpurec/runtime/terminate.py,
tpurec/runtime/interrupts.py); SIGKILL (an OOM kill, a power cut) gives the process no chance. What it leaves
is recognisable by name: parts and `_dataset.json` written as `NAME.tmp-PID` inside `--out` (by
`data convert` / `data synth`), and `.synth-NAME.tmp-XXXXXXXX` directories beside the synthetic-data
cache entries (`tpurec train`). The next writer removes them, and says so in one line:

* inside `--out` while it holds the directory's lock (tpurec/data/out_lock.py), so no live writer
  can own them;
* in the cache, a `.synth-NAME.tmp-*` directory whose own lock (`.lock`, held by the writer filling it) can be taken,
  or that has no lock and was last changed over a minute ago (a writer holds none only for the
  moments between making the directory and locking it, and between finishing and renaming it).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tpurec.runtime.dir_lock import LOCK, lock_dir

# What convert and synth name their files until they are complete (`part-N.parquet.tmp-PID`,
# `_dataset.json.tmp-PID`).
TMP_FILE_GLOBS = ("*.parquet.tmp-*", "_dataset.json.tmp-*")
# What tpurec/dlrm/data.py names a synthetic-data cache entry being made (mkdtemp prefix).
TMP_DIR_GLOB = ".synth-*.tmp-*"
UNLOCKED_GRACE_S = 60.0


def remove_tmp_files(out: Path, say: Callable[[str], object]) -> list[Path]:
    """Remove the temporary files a killed run left in `out` (call with `out`'s lock held)."""
    found = sorted({f for g in TMP_FILE_GLOBS for f in out.glob(g) if f.is_file()})
    for f in found:
        f.unlink(missing_ok=True)
    if found:
        names = ", ".join(f.name for f in found[:3]) + (", ..." if len(found) > 3 else "")
        say(f"removed {len(found)} temporary file(s) that a killed run left in {out} ({names})")
    return found


def remove_stale_tmp_dirs(parent: Path, say: Callable[[str], object]) -> list[Path]:
    """Remove the cache entries being made in `parent` whose writer is gone."""
    removed = []
    for d in sorted(parent.glob(TMP_DIR_GLOB)) if parent.is_dir() else []:
        if d.is_dir() and _abandoned(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        say(f"removed {len(removed)} temporary director(ies) that a killed run left: {', '.join(map(str, removed))}")
    return removed


def _abandoned(d: Path) -> bool:
    if not (d / LOCK).exists():
        try:
            return time.time() - d.stat().st_mtime > UNLOCKED_GRACE_S
        except FileNotFoundError:
            return False
    try:
        held = lock_dir(d, lambda holder: RuntimeError(holder))
    except (RuntimeError, OSError):
        return False  # its writer is alive
    held.close()  # the directory goes next; its lock file with it
    return True
