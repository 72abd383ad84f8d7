"""TorchRec's own example programs train with only the DMP class swapped for tpurec's, with losses
equal to stock TorchRec's (issue #27).

The examples are not in the torchrec wheel and are not committed here: point TORCHREC_EXAMPLES at
the `examples` directory of a checkout of TorchRec's repository (docs/dmp.md names the commit
checked). The two-tower example also imports faiss (faiss-cpu) and click. Each example's own
`train()` runs at 2 gloo ranks, its sizes set through its own parameters (as its own test does),
once with `DistributedModelParallel` bound to stock TorchRec's and once to tpurec's; the rank side
(`examples_harness.py`) gives both the same initial tables and batches.

  TORCHREC_EXAMPLES=/tmp/torchrec_checkout/examples python -m pytest tests/examples_torchrec -m slow
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.examples_torchrec.examples_harness import assemble, run
from tests.sharding.multiprocess import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
# The examples' own tests' arguments (embedding_dim=16, num_iterations=10, two-tower layer_sizes=[16])
# with 10k-row tables instead of their default 1M: large enough that stock TorchRec's planner shards
# them (table-wise on FBGEMM's fused kernel) rather than replicating them (below). The two-tower
# example's FAISS index over the trained item table, built after training, is kept small too.
ARGS = {
    "golden_training": {"num_embeddings": 10_000, "embedding_dim": 16, "num_iterations": 10},
    "two_tower": {
        "num_embeddings": 10_000,
        "embedding_dim": 16,
        "layer_sizes": [16],
        "num_iterations": 10,
        "num_centroids": 4,
        "num_subquantizers": 4,
        "bits_per_code": 4,
        "num_probe": 2,
    },
}


@pytest.fixture(scope="module")
def examples_dir() -> str:
    where = os.environ.get("TORCHREC_EXAMPLES")
    if not where or not (Path(where) / "golden_training" / "train_dlrm.py").is_file():
        pytest.skip("set TORCHREC_EXAMPLES to the examples directory of a checkout of TorchRec's repository")
    return where


def _train(examples_dir: str, example: str, dmp: str, world_size: int = WORLD_SIZE, **kwargs) -> list:
    return run_ranks(run, world_size, examples_dir, example, dmp, kwargs, timeout=900, init_group=False)


@pytest.mark.parametrize("example", ["golden_training", "two_tower"])
def test_example_trains_like_stock_torchrec_with_only_the_dmp_class_swapped(examples_dir, example):
    if example == "two_tower":
        pytest.importorskip("faiss", reason="the two-tower example imports faiss: pip install faiss-cpu")
        pytest.importorskip("click", reason="the two-tower example imports click")
    stock = _train(examples_dir, example, "stock", **ARGS[example])
    ours = _train(examples_dir, example, "tpurec", **ARGS[example])
    for rank, (s, o) in enumerate(zip(stock, ours)):
        # Stock's planner replicates small tables (data_parallel, dense kernel), where TorchRec drops the
        # example's in-backward optimizer; tpurec never replicates. The sizes keep stock off that path.
        assert {kernel for _, kernel in s["plan"].values()} == {"fused"}, s["plan"]
        assert {kernel for _, kernel in o["plan"].values()} == {"customized_kernel"}, o["plan"]
        assert len(s["losses"]) == ARGS[example]["num_iterations"]
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-5, atol=0, msg=f"rank {rank} losses")
    # the trained tables, assembled from either plan's shards
    stock_tables, our_tables = assemble([r["tables"] for r in stock]), assemble([r["tables"] for r in ours])
    assert sorted(our_tables) == sorted(stock_tables)
    for key, want in stock_tables.items():
        torch.testing.assert_close(our_tables[key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_golden_training_data_parallel_variant_is_refused_naming_the_replicated_table(examples_dir):
    """train_dlrm_data_parallel.py hands DMP a plan from TorchRec's planner with table t_cat_10 forced
    data-parallel; tpurec refuses data-parallel by design (no dense table gradient under a fused
    SparseCore update), by name, before training."""
    with pytest.raises(RuntimeError) as failed:
        _train(examples_dir, "golden_training_data_parallel", "tpurec", world_size=1, **ARGS["golden_training"])
    said = str(failed.value)
    assert "table 't_cat_10': sharding_type 'data_parallel' is not run by tpurec's SparseCore kernel" in said
