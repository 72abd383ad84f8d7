"""Checkpoints of one tiny `tpurec train` run, shared by the checkpoint tests of this folder: trained
once per session (about 15 s), copied for each test that damages or resumes them."""

from __future__ import annotations

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
