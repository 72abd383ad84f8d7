"""A DLRM trains under tpurec.DistributedModelParallel with TorchRec's TrainPipelineSparseDist."""

import pytest

from .dlrm_case import train_dlrm
from .multiprocess import run_ranks


@pytest.mark.multiprocess
def test_dlrm_trains_with_train_pipeline_sparse_dist_at_world_size_2():
    steps = 40
    results = run_ranks(train_dlrm, 2, steps, timeout=600)
    for r in results:
        assert r["kernels"] == ["customized_kernel"], r["kernels"]  # every table on tpurec's kernel
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert last < 0.8 * first, r["losses"]
