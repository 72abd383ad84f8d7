"""cgroup memory limits (issue #43): both the v1 and the v2 limit bound the memory tpurec plans
with, so a run too big for its container is refused in one line instead of OOM-killed.

Before: only cgroup v2's memory.max was read; under a v1 limit (memory.limit_in_bytes, still what
many hosts and container runtimes ship) the host's MemAvailable was taken as room.

The cgroup filesystem is faked: a directory laid out as /sys/fs/cgroup and a /proc/self/cgroup file.
"""

from __future__ import annotations

from pathlib import Path

from tpurec.runtime.host_resources import _cgroup_room

V1_UNLIMITED = 9223372036854771712  # what the kernel writes for "no limit" on 4 KiB pages
GiB = 1 << 30


def _group(root: Path, rel: str, files: dict[str, int | str]) -> None:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name).write_text(f"{value}\n")


def _self(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "self-cgroup"
    p.write_text(text)
    return p


V1_SELF = "9:name=systemd:/\n5:devices:/\n4:memory:/jobs/a\n1:cpu,cpuacct:/\n0::/\n"


def test_a_cgroup_v1_memory_limit_is_read(tmp_path):
    root = tmp_path / "cg"
    _group(root, "memory", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 40 * GiB})
    _group(root, "memory/jobs", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 3 * GiB})
    _group(root, "memory/jobs/a", {"memory.limit_in_bytes": 4 * GiB, "memory.usage_in_bytes": 1 * GiB})
    assert _cgroup_room(root, _self(tmp_path, V1_SELF)) == 3 * GiB


def test_a_cgroup_v1_limit_on_a_parent_group_binds_its_children(tmp_path):
    root = tmp_path / "cg"
    _group(root, "memory/jobs", {"memory.limit_in_bytes": 8 * GiB, "memory.usage_in_bytes": 7 * GiB})
    _group(root, "memory/jobs/a", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 1 * GiB})
    assert _cgroup_room(root, _self(tmp_path, V1_SELF)) == 1 * GiB


def test_cgroup_v1_unlimited_everywhere_is_no_limit(tmp_path):
    root = tmp_path / "cg"
    _group(root, "memory", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 40 * GiB})
    _group(root, "memory/jobs/a", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": GiB})
    assert _cgroup_room(root, _self(tmp_path, V1_SELF)) is None


def test_cgroup_v1_inside_a_container_reads_the_mount_root(tmp_path):
    """Without a cgroup namespace the path names the host's group, absent under the container's
    mount, whose root is the container's own group."""
    root = tmp_path / "cg"
    _group(root, "memory", {"memory.limit_in_bytes": 2 * GiB, "memory.usage_in_bytes": GiB // 2})
    assert _cgroup_room(root, _self(tmp_path, "4:memory:/docker/0123abcd\n")) == GiB + GiB // 2


def test_a_cgroup_v2_memory_limit_is_still_read(tmp_path):
    root = tmp_path / "cg"
    _group(root, "", {"memory.max": "max", "memory.current": 40 * GiB})
    _group(root, "user.slice/job", {"memory.max": 6 * GiB, "memory.current": 2 * GiB})
    assert _cgroup_room(root, _self(tmp_path, "0::/user.slice/job\n")) == 4 * GiB
    _group(root, "user.slice/job", {"memory.max": "max"})
    assert _cgroup_room(root, _self(tmp_path, "0::/user.slice/job\n")) is None


def test_the_v1_limit_caps_available_bytes(tmp_path, monkeypatch):
    from tpurec.runtime import host_resources

    root = tmp_path / "cg"
    _group(root, "memory/jobs/a", {"memory.limit_in_bytes": 4 * GiB, "memory.usage_in_bytes": 3 * GiB})
    monkeypatch.delenv("TPUREC_HOST_MEMORY_BYTES", raising=False)
    monkeypatch.setattr(host_resources, "_meminfo_available", lambda: 100 * GiB)
    real = host_resources._cgroup_room
    monkeypatch.setattr(host_resources, "_cgroup_room", lambda: real(root, _self(tmp_path, V1_SELF)))
    assert host_resources.available_bytes() == GiB


def test_the_inactive_file_cache_counts_as_room(tmp_path):
    """The kernel reclaims it before an OOM kill: usage minus it is what the group holds."""
    root = tmp_path / "cg"
    _group(root, "memory/jobs/a", {"memory.limit_in_bytes": 4 * GiB, "memory.usage_in_bytes": 3 * GiB})
    (root / "memory/jobs/a/memory.stat").write_text(f"cache 1\ninactive_file 5\ntotal_inactive_file {2 * GiB}\n")
    assert _cgroup_room(root, _self(tmp_path, V1_SELF)) == 3 * GiB
    _group(root, "v2/job", {"memory.max": 4 * GiB, "memory.current": 3 * GiB})
    (root / "v2/job/memory.stat").write_text(f"anon 1\ninactive_file {GiB}\n")
    assert _cgroup_room(root, _self(tmp_path, "0::/v2/job\n")) == 2 * GiB
