"""torch.distributed.checkpoint round trips: across world sizes, sharding types, and stock TorchRec."""

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from . import dmp_cases as c
from .multiprocess import run_ranks


def gathered(results, key="outs"):
    """Per-step outputs of all ranks concatenated along the batch (as one global batch)."""
    per_rank = [r[key] for r in results]
    return [torch.cat([p[step] for p in per_rank]) for step in range(len(per_rank[0]))]


def _whole(results) -> dict:
    """Every tensor of the ranks' `shard_values`, assembled whole from its shards at their offsets."""
    parts: dict = {}
    for r in results:
        for key, shards in r["shards"].items():
            parts.setdefault(key, []).extend(shards)
    out = {}
    for key, shards in parts.items():
        size = [max(o[d] + t.shape[d] for o, t in shards) for d in range(shards[0][1].dim())]
        whole = torch.full(size, float("nan"), dtype=shards[0][1].dtype)
        for offsets, t in shards:
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
        out[key] = whole
    return out


def assert_started_from(results, init: dict) -> None:
    """Each rank's shards, right after the unsharded tables were loaded, hold the values at their
    offsets (a shard shifted by a row keeps its shape: only its values show it)."""
    for r in results:
        assert r["start"], "no sharded tables"
        for key, shards in r["start"].items():
            for offsets, t in shards:
                want = init[key][tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))]
                assert torch.equal(t, want.to(t.dtype)), f"{key} at {offsets}: not the loaded table's values"


def assert_same_values(loaded, saved, keys=None):
    """Each rank's loaded shard holds the saved values at its offsets, bit for bit: a shard of the
    right shape at the wrong offset (a row-wise shard shifted by one row) fails."""
    want = _whole(saved)
    got = _whole(loaded)
    keys = sorted(set(want) & set(got)) if keys is None else keys
    assert keys, (sorted(want), sorted(got))
    for key in keys:
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), f"{key}: loaded shard values differ from the saved ones"
        for r in loaded:  # and each shard is where its metadata says (not only the union)
            for offsets, t in r["shards"].get(key, []):  # a rank without the table has no entry
                assert torch.equal(t, want[key][tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))]), key


def roundtrip(tmp_path, save_ws, save_sharding, save_stock, load_ws, load_sharding, load_stock):
    init = EmbeddingBagCollection(c.tables()).state_dict()
    path = str(tmp_path / "ckpt")
    saved_ranks = run_ranks(c.checkpoint_save, save_ws, path, init, save_sharding, save_stock, timeout=600)
    loaded = run_ranks(c.checkpoint_load, load_ws, path, load_sharding, load_stock, timeout=600)
    assert_started_from(saved_ranks, init)
    assert_same_values(loaded, saved_ranks)
    saved = gathered(saved_ranks)
    before, after = gathered(loaded, "before"), gathered(loaded, "after")
    assert not torch.allclose(before[0], saved[0]), "the fresh model must differ before loading"
    for got, want in zip(after, saved):
        # weights load bit-exactly; outputs of another sharding may sum partial bags in another order
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # about 90 s of spawned ranks each: `make test-all` (the default suite's 20 minutes)
@pytest.mark.multiprocess
def test_dcp_save_at_2_load_at_4_other_sharding(tmp_path):
    roundtrip(tmp_path, 2, "row_wise", False, 4, "column_wise", False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dcp_save_at_2_load_at_1(tmp_path):
    roundtrip(tmp_path, 2, "table_wise", False, 1, "table_row_wise", False)


@pytest.mark.slow  # about 90 s of spawned ranks each: `make test-all` (the default suite's 20 minutes)
@pytest.mark.multiprocess
def test_stock_torchrec_checkpoint_loads_into_tpurec_and_back(tmp_path):
    # stock TorchRec (FBGEMM fused kernel) -> tpurec
    roundtrip(tmp_path / "a", 2, "table_wise", True, 2, "row_wise", False)
    # tpurec -> stock TorchRec
    roundtrip(tmp_path / "b", 2, "column_wise", False, 2, "table_wise", True)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "optim,save_sharding,load_ws,load_sharding",
    [
        # resume at another world size; 75 s: `make test-all` (the default suite's 20 minutes)
        pytest.param("rowwise_adagrad", "row_wise", 4, "table_row_wise", marks=pytest.mark.slow),
        # Adam in make test-all (default suite time: 11-23 s here); DCP resumes of the fused state stay
        # below (in place, a rank without tables), Adam's in tests/embedding/test_fused_updates.py
        pytest.param("adam", "column_wise", 2, "column_wise", marks=pytest.mark.slow),
    ],
)
def test_fused_optimizer_state_resumes_exactly_through_dcp(tmp_path, optim, save_sharding, load_ws, load_sharding):
    init = EmbeddingBagCollection(c.tables()).state_dict()
    path = str(tmp_path / "ckpt")
    saved = run_ranks(c.optimizer_checkpoint_save, 2, path, init, save_sharding, optim, timeout=600)
    uninterrupted = gathered(saved)
    assert_started_from(saved, init)
    resumed = run_ranks(c.optimizer_checkpoint_resume, load_ws, path, load_sharding, optim, 2, timeout=600)
    assert "embedding_bags.t0.weight" in resumed[0]["optim_keys"]
    assert_same_values(resumed, saved, keys=sorted(_whole(saved)))  # tables and optimizer state
    for got, want in zip(gathered(resumed, "outs"), uninterrupted):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_dcp_save_and_load_of_model_and_optimizer_where_a_rank_holds_no_table(tmp_path):
    """Rank 1 holds no table (as 4 table-wise tables leave 4 of 8 ranks). Its fused optimizer had an
    empty state entry per table, which dcp.load flattened into a key no checkpoint holds ("Missing key
    in checkpoint state_dict: optim.state.embedding_bags.t0.weight", the 8-rank quickstart's crash)."""
    init = EmbeddingBagCollection(c.tables()).state_dict()
    path = str(tmp_path / "ckpt")
    ranks = run_ranks(c.optimizer_checkpoint_roundtrip, 2, path, init, "table_wise_on_rank0", "rowwise_adagrad")
    # rank 0 holds every table; rank 1 none, so it keys every table's state without local shards
    want = ["embedding_bags.t0.weight", "embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert [r["optim_keys"] for r in ranks] == [want, want]
    assert ranks[1]["loaded"] and all(shards == [] for shards in ranks[1]["loaded"].values())
    loaded = [{"shards": r["loaded"]} for r in ranks]
    assert_same_values(loaded, ranks, keys=sorted(_whole(ranks)))  # tables and optimizer state
    assert sorted(_whole(ranks)) == sorted(_whole(loaded))
    assert any("momentum1" in k for k in _whole(ranks))
    for got, want_out in zip(gathered(ranks, "resumed"), gathered(ranks, "outs")):
        torch.testing.assert_close(got, want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "optim,sharding",
    [  # about 48 s each: two of the three are `make test-all` (the default suite's 20 minutes); the
        # default one is row-wise: a row shard shifted by one keeps its shape, only values show it
        ("rowwise_adagrad", "row_wise"),
        pytest.param("sgd", "column_wise", marks=pytest.mark.slow),
        pytest.param("adam", "table_wise", marks=pytest.mark.slow),
    ],
)
def test_dcp_load_in_place_without_load_state_dict_restores_tables_and_state(tmp_path, optim, sharding):
    """DCP (and TorchRec's copy_state_dict) write into the tensors state_dict() returned; tpurec's are
    views of the live tables and optimizer state, so nothing else is needed to resume exactly."""
    init = EmbeddingBagCollection(c.tables()).state_dict()
    path = str(tmp_path / "ckpt")
    saved = run_ranks(c.optimizer_checkpoint_save, 2, path, init, sharding, optim, timeout=600)
    uninterrupted = gathered(saved)
    assert_started_from(saved, init)
    resumed = run_ranks(c.optimizer_checkpoint_resume, 2, path, sharding, optim, 2, True, timeout=600)
    assert_same_values(resumed, saved, keys=sorted(_whole(saved)))  # tables and optimizer state, in place
    for got, want in zip(gathered(resumed, "outs"), uninterrupted):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
