"""Weighted features with MEAN pooling under DMP: what stock TorchRec does, and what tpurec does.

Stock TorchRec on CPU (FBGEMM's CPU TBE, table-wise) pools sum(w e) / L but updates each row with
w g, not with the gradient of its output (w g / L): FBGEMM's CPU `csr2csc` drops the 1/L when weights
are given ("MEAN pooling will not work with indice_weights!"), and so does its CPU weights-gradient
kernel, while FBGEMM's CUDA backward divides the output gradient by L whatever the weights
(`grad_mean_kernel`). tpurec's update is the gradient of its output, as its TPU path feeds the
SparseCore's update op the lookup's gains (w / L); docs/dmp.md says so. Under row-wise sharding both
run TorchRec's mean-pooling callback, which divides by the sum of the weights (plus 1e-6), not by L.

Each run is checked against a plain-torch oracle of the rule it follows, so a change on either side
shows here."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tpurec.sharding.dmp import _ensure_process_group

ROWS, DIM, BATCH, STEPS, LR, EPS = 30, 8, 16, 3, 0.05, 1e-6


def _tables():
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"], pooling=PoolingType.MEAN
        )
        for i in range(2)
    ]


def _batches():
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 5, (2 * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        weights = torch.rand(values.numel(), generator=gen) * 2 + 0.25
        upstream = torch.randn(BATCH, 2 * DIM, generator=gen)
        out.append((KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, weights=weights), upstream))
    return out


def _start(i: int) -> torch.Tensor:
    return torch.linspace(-0.3, 0.3, ROWS * DIM).view(ROWS, DIM) * (i + 1)


def _oracle(optim: str, divisor: str, grad_scale: str):
    """Plain torch: bag = sum(w e) / d with d = L ("length") or sum(w) + 1e-6 ("weights", TorchRec's
    row-wise callback); each id's row gets coef * upstream, coef = w / d ("gradient") or w ("w");
    then SGD or row-wise Adagrad on the touched rows. Returns (outputs per step, tables)."""
    tables = [_start(i) for i in range(2)]
    accs = [torch.zeros(ROWS) for _ in range(2)]
    outs = []
    for kjt, upstream in _batches():
        cols = []
        grads = []
        for k, key in enumerate(("f0", "f1")):
            jt = kjt[key]
            ids, w, lengths = jt.values(), jt.weights(), jt.lengths()
            bag = torch.repeat_interleave(torch.arange(BATCH), lengths)
            wsum = torch.zeros(BATCH).index_add_(0, bag, w)
            d = lengths.clamp(min=1).to(torch.float32) if divisor == "length" else wsum + 1e-6
            pooled = torch.zeros(BATCH, DIM).index_add_(0, bag, w[:, None] * tables[k][ids]) / d[:, None]
            cols.append(pooled)
            coef = w / d[bag] if grad_scale == "gradient" else w
            up = upstream[:, k * DIM : (k + 1) * DIM]
            touched = torch.zeros(ROWS, dtype=torch.bool)
            touched[ids] = True
            grads.append((torch.zeros(ROWS, DIM).index_add_(0, ids, coef[:, None] * up[bag]), touched))
        outs.append(torch.cat(cols, 1))
        for k, (g, touched) in enumerate(grads):
            if optim == "sgd":
                tables[k][touched] -= LR * g[touched]
            else:
                accs[k][touched] += (g[touched] ** 2).mean(1)
                tables[k][touched] -= LR * g[touched] / (accs[k][touched].sqrt() + EPS)[:, None]
    return outs, tables


def _train(dmp_class, optim: str, sharding: str):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(tables=_tables(), is_weighted=True, device=torch.device("meta"))
    cls, kw = (torch.optim.SGD, {"lr": LR}) if optim == "sgd" else (RowWiseAdagrad, {"lr": LR, "eps": EPS})
    apply_optimizer_in_backward(cls, ebc.parameters(), kw)
    extra = {}
    if dmp_class is StockDMP or sharding == "row_wise":
        kernel = "fused" if dmp_class is StockDMP else "customized_kernel"
        gen = table_wise(rank=0, compute_kernel=kernel) if sharding == "table_wise" else row_wise(compute_kernel=kernel)
        extra["plan"] = ShardingPlan({"": construct_module_sharding_plan(ebc, {t.name: gen for t in _tables()})})
    model = dmp_class(ebc, device=torch.device("cpu"), **extra)
    assert {p.sharding_type for p in model.plan.plan[""].values()} == {sharding}
    with torch.no_grad():  # the same start for both (stock re-initialises the tables when sharding)
        for i in range(2):
            model.state_dict()[f"embedding_bags.t{i}.weight"].local_shards()[0].tensor.copy_(_start(i))
    outs = []
    for kjt, upstream in _batches():
        kt = model(kjt)
        parts = kt.to_dict()
        out = torch.cat([parts["f0"], parts["f1"]], 1)
        outs.append(out.detach().clone())
        (out * upstream).sum().backward()
    sd = model.state_dict()
    return outs, [sd[f"embedding_bags.t{i}.weight"].local_shards()[0].tensor.detach().clone() for i in range(2)]


def _close(got, want, what):
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=lambda m: f"{what} [{k}]: {m}")


@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad"])
def test_table_wise_weighted_mean_stock_updates_by_w_g_tpurec_by_its_gradient(optim):
    _ensure_process_group("cpu")
    stock_outs, stock_tables = _train(StockDMP, optim, "table_wise")
    ours_outs, ours_tables = _train(tpurec.DistributedModelParallel, optim, "table_wise")
    # the same lookup: sum(w e) / L
    torch.testing.assert_close(ours_outs[0], stock_outs[0], rtol=0, atol=1e-6)
    # stock (FBGEMM's CPU TBE) updates each row by w g; tpurec by the output's gradient, w g / L
    want_outs, want_tables = _oracle(optim, "length", "w")
    _close(stock_outs, want_outs, "stock outputs")
    _close(stock_tables, want_tables, "stock tables")
    want_outs, want_tables = _oracle(optim, "length", "gradient")
    _close(ours_outs, want_outs, "tpurec outputs")
    _close(ours_tables, want_tables, "tpurec tables")
    # the difference is not float noise: that is the choice docs/dmp.md states
    assert max((a - b).abs().max().item() for a, b in zip(ours_tables, stock_tables)) > 1e-3


def test_row_wise_weighted_mean_divides_by_the_weights_sum_in_stock_and_tpurec_alike():
    """TorchRec's row-wise mean-pooling callback (`_create_mean_pooling_divisor`) divides the summed
    bags by sum(w) + 1e-6 for a weighted KJT, around FBGEMM's kernel or tpurec's: equal outputs and
    updates (the gradient of those outputs), and a definition other than table-wise's."""
    _ensure_process_group("cpu")
    stock_outs, stock_tables = _train(StockDMP, "sgd", "row_wise")
    ours_outs, ours_tables = _train(tpurec.DistributedModelParallel, "sgd", "row_wise")
    want_outs, want_tables = _oracle("sgd", "weights", "gradient")
    _close(stock_outs, want_outs, "stock outputs")
    _close(stock_tables, want_tables, "stock tables")
    _close(ours_outs, want_outs, "tpurec outputs")
    _close(ours_tables, want_tables, "tpurec tables")


def test_fbgemms_cpu_tbe_drops_one_over_length_for_weighted_mean_in_both_gradients():
    """FBGEMM's CPU TBE itself (what stock TorchRec runs on CPU): a weighted MEAN bag pools
    sum(w e) / L, but the row update is lr * w * g and the weights' gradient <g, row>, both without
    the 1/L of the output's gradient. (tpurec's weights' gradient keeps it: tests/embedding/test_weight_grad.py.)"""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], learning_rate=1.0, pooling_mode=PoolingMode.MEAN
    )  # EXACT_SGD
    table = tbe.split_embedding_weights()[0]
    with torch.no_grad():
        table.copy_(torch.linspace(-1, 1, 40).view(10, 4))
    before = table.detach().clone()
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 3])
    w = torch.tensor([0.5, 2.0, 3.0], requires_grad=True)
    out = tbe(ids, offsets, per_sample_weights=w)
    torch.testing.assert_close(out[0], (w[:, None] * before[ids]).sum(0) / 3)
    upstream = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    (out * upstream).sum().backward()
    torch.testing.assert_close(before[ids] - table[ids].detach(), w.detach()[:, None] * upstream)  # lr * w * g
    assert w.grad is not None
    torch.testing.assert_close(w.grad, (before[ids] * upstream).sum(1))  # <g, row>, no / 3
