"""Sharded EmbeddingCollections on tpurec's kernel equal unsharded training and stock TorchRec, on
real ranks over gloo; DCP checkpoints travel both ways between tpurec and stock TorchRec.

Every rank feeds its samples of the same global batches; the reference is an unsharded
SparseCoreEmbeddingCollection (and, for SGD and row-wise Adagrad, torchrec's EmbeddingCollection +
the torch optimizer) trained on the global batches with upstream / world_size (TorchRec averages
embedding gradients over ranks, in sequence sharding as in pooled)."""

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingCollection

from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

from . import dmp_cases as dc
from . import ec_cases as c
from .multiprocess import run_ranks

STEPS = 3


def reference(optim_name, init_state, world_size, dense=False):
    optim, kwargs = dc.optimizer(optim_name)
    if dense:
        model = EmbeddingCollection(tables=c.tables())
        opt = optim(model.parameters(), **kwargs)
    else:
        model = SparseCoreEmbeddingCollection(c.tables(), optim, kwargs, num_sparsecores=2)
        opt = None
    model.load_state_dict(init_state)
    outs = []
    for kjt, upstream in c.global_batches(STEPS, 8):
        out = model(kjt)
        outs.append({k: out[k].values().detach().clone() for k in c.KEYS})
        if opt is not None:
            opt.zero_grad()
        sum((out[k].values() * upstream[k] / world_size).sum() for k in c.KEYS).backward()
        if opt is not None:
            opt.step()
    return outs, model.state_dict()


def gathered(results, key, step):
    """A step's outputs of all ranks, per feature, concatenated in rank (= sample) order."""
    return {k: torch.cat([r[key][step][k] for r in results]) for k in c.KEYS}


def assert_matches(results, key, ref_outs, what):
    for step, want in enumerate(ref_outs):
        got = gathered(results, key, step)
        for k in c.KEYS:
            torch.testing.assert_close(
                got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} step {step} {k}: {m}"
            )


CASES = [
    # (sharding, optimizer, compare with stock TorchRec's fused kernel too)
    # SGD's two cases in make test-all (default suite time: 11-17 s each here): TW and CW ECs stay in
    # test_torchrec_sequence_harness.py's default cases, stock's fused kernel in the row-wise case below
    pytest.param("table_wise", "sgd", True, marks=pytest.mark.slow),
    pytest.param("column_wise", "sgd", True, marks=pytest.mark.slow),
    ("column_wise", "adam", False),  # FBGEMM's CPU TBE has no fused Adam
    ("row_wise", "rowwise_adagrad", True),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world_size", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("sharding,optim_name,with_stock", CASES)
def test_sharded_ec_equals_unsharded_and_stock_torchrec(world_size, sharding, optim_name, with_stock):
    init = EmbeddingCollection(tables=c.tables()).state_dict()
    results = run_ranks(c.run_case, world_size, sharding, optim_name, init, STEPS, with_stock, timeout=900)
    ref_outs, ref_tables = reference(optim_name, init, world_size)
    assert_matches(results, "outs", ref_outs, f"{sharding} {optim_name} vs unsharded")
    for key, want in ref_tables.items():
        torch.testing.assert_close(results[0]["tables"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    if optim_name != "adam":  # dense-equivalent optimizers: also torchrec's EC + torch optimizer
        _, dense = reference(optim_name, init, world_size, dense=True)
        for key, want in dense.items():
            torch.testing.assert_close(results[0]["tables"][key], want, rtol=1e-5, atol=1e-6)
    if with_stock:
        assert_matches(results, "stock_outs", [gathered(results, "outs", s) for s in range(STEPS)], "vs stock")
        for key, want in results[0]["stock_tables"].items():
            torch.testing.assert_close(
                results[0]["tables"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"stock {key}: {m}"
            )


@pytest.mark.multiprocess
def test_tpurec_dmp_plans_and_shards_a_model_holding_an_ec():
    init = EmbeddingCollection(tables=c.tables()).state_dict()
    results = run_ranks(c.run_with_planner, 2, init, STEPS, timeout=900)
    plan = results[0]["plan"]
    assert set(plan) == {"t0", "t1", "t2"}
    assert all(
        kernel == "customized_kernel" and st in ("table_wise", "column_wise", "row_wise")
        for st, kernel in plan.values()
    )
    ref_outs, ref_tables = reference("rowwise_adagrad", init, 2)
    assert_matches(results, "outs", ref_outs, f"planned {plan}")
    for key, want in ref_tables.items():
        torch.testing.assert_close(results[0]["tables"][f"ec.{key}"], want, rtol=1e-5, atol=1e-6)


def _roundtrip(tmp_path, save_sharding, save_stock, load_ws, load_sharding, load_stock):
    init = EmbeddingCollection(tables=c.tables()).state_dict()
    path = str(tmp_path / "ckpt")
    saved = run_ranks(c.checkpoint_save, 2, path, init, save_sharding, save_stock, timeout=600)
    loaded = run_ranks(c.checkpoint_load, load_ws, path, load_sharding, load_stock, timeout=600)
    want = {k: torch.cat([r[k] for r in saved]) for k in c.KEYS}
    before = {k: torch.cat([r["before"][k] for r in loaded]) for k in c.KEYS}
    after = {k: torch.cat([r["after"][k] for r in loaded]) for k in c.KEYS}
    assert not torch.allclose(before["f0"], want["f0"]), "the fresh model must differ before loading"
    for k in c.KEYS:
        assert torch.equal(after[k], want[k]), k  # unpooled: every output row is one stored row, bit-exact


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
@pytest.mark.multiprocess
def test_dcp_checkpoints_travel_between_stock_torchrec_ec_and_tpurec(tmp_path):
    _roundtrip(tmp_path / "a", "table_wise", True, 2, "row_wise", False)  # stock TorchRec -> tpurec
    _roundtrip(tmp_path / "b", "column_wise", False, 2, "table_wise", True)  # tpurec -> stock TorchRec


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dcp_reshards_ec_from_2_to_4_ranks(tmp_path):
    _roundtrip(tmp_path, "row_wise", False, 4, "column_wise", False)
