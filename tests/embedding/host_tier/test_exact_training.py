"""Training with tables on the host tier gives the all-resident run's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.types import CacheParams

from tests.embedding.helpers import fused_optimizers

from . import training

STEPS = 300


@pytest.mark.parametrize("algorithm", [CacheAlgorithm.LRU, CacheAlgorithm.LFU], ids=["lru", "lfu"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad", "adam"])
def test_300_steps_with_a_cache_of_a_tenth_of_the_rows_equal_the_resident_run(optimizer, algorithm):
    opt = fused_optimizers()[optimizer]
    data = training.batches(STEPS)
    resident = training.build(opt)
    want_losses = training.train(resident, data)
    cache = {name: CacheParams(load_factor=0.1, algorithm=algorithm) for name in ("t0", "t2")}
    tiered = training.build(opt, cache)
    got_losses = training.train(tiered, data)

    assert torch.equal(got_losses, want_losses)
    for name, rows in (("t0", 1000), ("t2", 2000)):
        tier = tiered.ebc.kernel.host_tier[name]
        c = tier.counters
        assert tier.params.cached_rows == rows // 10
        assert c.batches == STEPS
        # the cache both hit and evicted: the copies in both directions were exercised
        assert c.hits > 0 and c.evictions > 0 and c.writebacks > 0
        # it filled once, then every row loaded evicted one
        assert len(tier.cached_rows()) == rows // 10 and c.misses - c.evictions == rows // 10
    want, got = training.tables_and_state(resident), training.tables_and_state(tiered)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_layout_path_runs_the_host_tier_to_within_float_rounding(monkeypatch):
    """With the SparseCore layout (TPUREC_NO_DIRECT=1, as with fixed id limits) a bag's rows are
    summed in partition order, which follows the slots, not the rows: the same training up to the
    order of float32 additions."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    opt = fused_optimizers()["rowwise_adagrad"]
    data = training.batches(60)
    resident = training.build(opt)
    want_losses = training.train(resident, data)
    tiered = training.build(opt, {"t0": CacheParams(load_factor=0.1), "t2": CacheParams(load_factor=0.1)})
    got_losses = training.train(tiered, data)

    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    want, got = training.tables_and_state(resident), training.tables_and_state(tiered)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)
    assert tiered.ebc.kernel.host_tier_counters()["t0"].evictions > 0
