"""Shared test setup: no TPU here, so pin jax to CPU and keep a torch_tpu install dormant."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402

from tpurec.runtime.gc_tuning import collect_less  # noqa: E402

# As the `tpurec` command does: the test process imports torch, TorchRec, numba and jax, and full
# collections over those objects took 3% of tests/embedding's time (2.2 of 68 s; 0.45 s after this).
collect_less()

REPO = Path(__file__).resolve().parents[1]
# The real Criteo fixture sits in ../shared/data beside the clone (CI copies shared/ there too).
CRITEO_SAMPLE = REPO.parent / "shared" / "data" / "criteo_sample.csv"


@pytest.fixture
def criteo_sample() -> Path:
    if not CRITEO_SAMPLE.exists():
        pytest.skip(f"{CRITEO_SAMPLE} not found")
    return CRITEO_SAMPLE


def pytest_collection_modifyitems(config, items):
    # TPU-only tests run only where tpurec says the SparseCore backend is usable.
    from tpurec.runtime.device import tpu_status

    if tpu_status().usable:
        return
    skip = pytest.mark.skip(reason="needs a TPU host with torch_tpu and libtpu")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)
