"""What this host has room for: memory a process may still use, and free disk space where a path
would be written. Sizes a user gives (tables trained on CPU, synthetic rows) are checked against them
before any work starts, so a request the host cannot hold is one line at once, not an OOM kill or a
full disk an hour later."""

from __future__ import annotations

import os
from pathlib import Path

# What a rank process holds besides its tables (torch, torchrec, the dense model, readers, batches):
# measured ~0.93 GiB peak RSS for a dlrm-tiny training rank on CPU (`/usr/bin/time -v tpurec train
# --steps 20`), rounded up. Used to size CPU training (tpurec.dlrm.rank_setup) and emulated slices.
RANK_OVERHEAD_BYTES = 1 << 30


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


# cgroup v1 writes "no limit" as the largest page-aligned counter (9223372036854771712 on 4 KiB
# pages); any limit this large cannot be a real one on any host
_V1_UNLIMITED = 1 << 62


def _cgroup_room(
    root: str | os.PathLike = "/sys/fs/cgroup", self_cgroup: str | os.PathLike = "/proc/self/cgroup"
) -> int | None:
    """Memory this process's cgroup may still charge: the least limit - usage over its group and the
    groups above it (a parent's limit binds its children too), or None when none is limited. Usage
    leaves out the group's inactive file cache (memory.stat), which the kernel reclaims before it
    OOM-kills: a container that read large files is not out of memory (the working set, as kubelet
    and `docker stats` count it).

    Both hierarchies are read: cgroup v2 (memory.max / memory.current, line `0::PATH`) and cgroup v1
    (memory/memory.limit_in_bytes / memory.usage_in_bytes, line `N:...memory...:PATH`); hosts and
    container runtimes still ship v1, where reading only v2 left the limit unseen and a run was
    OOM-killed instead of refused. `root` and `self_cgroup` are parameters for tests."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            room = _group_room(Path(root), path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")  # total_: with children
            room = _group_room(Path(root) / "memory", path, *v1)
        else:
            continue
        if room is not None:
            rooms.append(room)
    return min(rooms) if rooms else None


def _group_room(mount: Path, path: str, limit_file: str, usage_file: str, cache_stat: str) -> int | None:
    """Least limit - usage from the group at `path` under `mount` up to the mount's root; None when
    no level has a limit (or the files are unreadable: not a cgroup of this kind).

    Inside a container without its own cgroup namespace the path names the host's group, absent
    under the container's mount, whose root is then the container's own group: start there."""
    group = mount / path.lstrip("/")
    if not group.is_dir():
        group = mount
    room = None
    while True:
        try:
            limit = (group / limit_file).read_text().strip()
            if limit != "max" and int(limit) < _V1_UNLIMITED:
                used = int((group / usage_file).read_text().strip()) - _stat(group, cache_stat)
                left = int(limit) - used
                room = left if room is None else min(room, left)
        except (OSError, ValueError):
            pass
        if group == mount or group.parent == group:
            return room
        group = group.parent


def _stat(group: Path, key: str) -> int:
    """Field `key` of the group's memory.stat (0 when absent or unreadable)."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


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
