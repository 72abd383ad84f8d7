"""Checkpoints of one tiny `tpurec train` run, shared by the checkpoint tests of this folder: trained
once per session (about 15 s), copied for each test that damages or resumes them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.reliability.inproc import copy_checkpoints, train_checkpoints


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """TPUREC_CACHE of the tiny runs: their synthetic dataset is made once in it."""
    return tmp_path_factory.mktemp("tpurec-cache")


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_cache) -> Path:
    """A checkpoint root holding step-00000002 and step-00000004 (read only: copy to change it)."""
    return train_checkpoints(tmp_path_factory.mktemp("trained") / "ck", tiny_cache)


@pytest.fixture
def checkpoints(trained, tmp_path, tiny_cache, monkeypatch) -> Path:
    """A copy of `trained` for this test, with TPUREC_CACHE set for runs that resume it."""
    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    return copy_checkpoints(trained, tmp_path / "ck")


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory no file can be created in: a read-only tmpfs as root (root ignores permission
    bits, not a read-only mount), else a directory without write permission."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"root, but mount -t tmpfs failed: {mounted.stderr.decode().strip()}")
        yield d, "Read-only file system"
        subprocess.run(["umount", str(d)], check=True)
    else:
        d.chmod(0o500)
        yield d, "Permission denied"
        d.chmod(0o700)


@pytest.fixture
def tsv(tmp_path) -> Path:
    """A raw Criteo TSV day file of 300 lines, for `data convert`."""
    from tpurec.bench.data import write_criteo_tsv

    path = tmp_path / "day_0"
    write_criteo_tsv(str(tmp_path), str(path), 300, seed=0)
    return path
