"""What this host has room for: memory a process may still use, and free disk space where a path
would be written. Sizes a user gives (tables trained on CPU, synthetic rows) are checked against them
before any work starts, so a request the host cannot hold is one line at once, not an OOM kill or a
full disk an hour later."""

from __future__ import annotations

import os
import shutil


def available_bytes() -> int | None:
    """Memory this process may still use: MemAvailable (free + reclaimable page cache) on Linux,
    capped by the cgroup's limit (a container's /proc/meminfo shows the host's memory); else free
    pages; else None. TPUREC_HOST_MEMORY_BYTES overrides it (tests; hosts that misreport)."""
    override = os.environ.get("TPUREC_HOST_MEMORY_BYTES")
    if override:
        return _override_bytes(override)
    found = _meminfo_available()
    limit = _cgroup_room()
    if found is not None and limit is not None:
        return min(found, limit)
    return found if found is not None else limit


def _override_bytes(text: str) -> int:
    """TPUREC_HOST_MEMORY_BYTES as a whole number of bytes >= 0 (UserError naming it otherwise:
    `abc`, `-1`, `1.5e9` were a ValueError traceback, or a negative room)."""
    from tpurec.errors import UserError

    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"TPUREC_HOST_MEMORY_BYTES={text!r}: not a whole number of bytes >= 0 (unset it to measure)")
    return value


def _cgroup_room() -> int | None:
    """cgroup v2 memory.max - memory.current of this process's cgroup, or None when unlimited."""
    from pathlib import Path

    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        group = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((group / "memory.current").read_text().strip())
    except (OSError, ValueError, StopIteration):
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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
