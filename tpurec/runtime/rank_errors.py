"""Errors a rank finds, printed once with the ranks that found them, not once per rank (issue #41).

Every rank of a multi-rank run checks the same input, so a bad flag or file is usually found by all of
them at once: 8 ranks printed 8 copies of the same line. Here a rank's one-line error goes:

* under a tpurec launcher (`tpurec launch`, `tpurec train --nproc N` / `--emulate-tpu`), to a file in
  the run directory the launcher made (`group_watch.WATCH_ENV`); the rank prints nothing. When the
  ranks have ended the launcher prints each distinct line once, with the ranks that raised it
  (`tpurec train: error: ranks 0-7: --plan p.json: file not found`; `collect`), and its agent leaves
  those ranks out of its own line on failed ranks (`tpurec.launch.agent`);
* under a torchrun tpurec does not own (`.venv/bin/torchrun ... -m tpurec.dlrm`), the first rank of
  each host to find a given line prints it (`... error: rank 3: ...`), the others of that host stay
  quiet: an exclusive-create file per line and run in the temporary directory decides, which takes no
  collective (a collective could wait forever on a rank that already left). Other hosts print their
  own copy;
* in one process, printed as before (`rank 0` when no RANK is set).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time

from tpurec.runtime.group_watch import WATCH_ENV

_PREFIX = "error-"  # rank R's error in the launcher's run directory: error-R (first line prefix, then message)
_STALE_S = 86400.0  # per-host markers of plain torchrun runs older than this are removed


def report(prefix: str, message: str) -> None:
    """Tell the user `prefix: rank R: message` once for the run (see the module's text). `prefix` is
    the command's (`tpurec train: error`); `message` is one line and does not name the rank."""
    rank = os.environ.get("RANK")
    where = os.environ.get(WATCH_ENV)
    if rank is not None and where and _record(where, rank, prefix, message):
        return
    if rank is not None and not _first_on_host(prefix, message):
        return
    print(f"{prefix}: rank {rank or 0}: {message}", file=sys.stderr, flush=True)


def _record(where: str, rank: str, prefix: str, message: str) -> bool:
    path = os.path.join(where, f"{_PREFIX}{rank}")
    try:  # whole or not at all: the launcher may read it at any moment
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{prefix}\n{message}")
        os.replace(path + ".tmp", path)
        return True
    except OSError:
        return False  # the launcher's directory gone: print it here


def _run_key() -> str | None:
    """What names this torchrun run on this host: its run id, restart count, and the agent (the ranks'
    parent) by pid and start time, so that a later run with the same run id ("none", torchrun's
    default without --rdzv-id) is another run. None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/stat", encoding="utf-8") as f:
            started = f.read().rpartition(")")[2].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        started = "?"
    return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{agent}/{started}"


def _first_on_host(prefix: str, message: str) -> bool:
    """Whether this rank is the first of this host's ranks of the run to report this line."""
    key = _run_key()
    if key is None:
        return True
    where = os.path.join(tempfile.gettempdir(), f"tpurec-rank-errors-{os.getuid()}")
    name = hashlib.sha256(f"{key}\n{prefix}\n{message}".encode()).hexdigest()[:32]
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        if os.stat(where).st_uid != os.getuid():
            return True  # someone else's directory: decide nothing by it
        fd = os.open(os.path.join(where, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    except OSError:
        return True
    os.close(fd)
    _prune(where)
    return True


def _prune(where: str) -> None:
    now = time.time()
    try:
        for entry in os.scandir(where):
            if now - entry.stat().st_mtime > _STALE_S:
                os.unlink(entry.path)
    except OSError:
        pass


def collect(where: str) -> list[str]:
    """The launcher's lines: each distinct (prefix, message) the ranks recorded in `where`, once, with
    the ranks that raised it, in the order of their lowest rank."""
    groups: dict[tuple[str, str], list[int]] = {}
    try:
        names = os.listdir(where)
    except OSError:
        return []
    for name in names:
        if not name.startswith(_PREFIX) or name.endswith(".tmp"):
            continue
        try:
            rank = int(name[len(_PREFIX) :])
            with open(os.path.join(where, name), encoding="utf-8") as f:
                prefix, _, message = f.read().partition("\n")
        except (OSError, ValueError):
            continue
        groups.setdefault((prefix, message), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: min(item[1]))
    return [f"{prefix}: {ranks_text(ranks)}: {message}" for (prefix, message), ranks in ordered]


def reported(where: str | None) -> set[int]:
    """The ranks that recorded an error in `where` (the launcher's run directory)."""
    if not where:
        return set()
    try:
        names = os.listdir(where)
    except OSError:
        return set()
    return {int(n[len(_PREFIX) :]) for n in names if n.startswith(_PREFIX) and n[len(_PREFIX) :].isdigit()}


def ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-7`, `ranks 0, 2, 5-7`."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
