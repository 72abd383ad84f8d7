"""The direct CPU step reproduces FBGEMM's CPU TBE bit for bit (issue #40 item 7): the same float32
additions in the same order, rounded where FBGEMM's compiled kernels round, so that a long CPU run
tracks stock TorchRec instead of parting from it once Adagrad has magnified a last-bit difference.

What is matched (tpurec/embedding/direct_kernels.py): pooled sums (and mean pooling's sum times
1 / length); each row's gradient summed over its entries in FBGEMM's csr2csc order (feature of the
table, then sample, then position), weighted entries as fma; SGD's `w -= lr * g` as one fma;
row-wise Adagrad's sum of squares in eight lanes (FBGEMM's SparseAdaGrad kernel, tables with one
feature) or one running sum (its generic loop, shared tables); element-wise Adagrad's momentum as
fma(g, g, m) and its step in FBGEMM's mixed precisions (lr * g in float32, the square root, eps and the
division in float64)."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim import RowWiseAdagrad

from tpurec.embedding import csr_build, direct
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

from .helpers import random_kjt

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed: no direct step")

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.3}, EmbOptimType.EXACT_SGD),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ADAGRAD),
}


def _pair(optimizer: str, dim: int, weighted: bool, shared: bool, mean: bool):
    torch.manual_seed(3)
    pooling = PoolingType.MEAN if mean else PoolingType.SUM
    tables = [
        # shared: one table read by two features (FBGEMM's generic CPU loop), else one feature each
        EmbeddingBagConfig(
            name="a", embedding_dim=dim, num_embeddings=30, feature_names=["fa", "fb"] if shared else ["fa"],
            pooling=pooling,
        ),
        EmbeddingBagConfig(name="c", embedding_dim=dim, num_embeddings=100, feature_names=["fc"], pooling=pooling),
    ]  # fmt: skip
    optim, kwargs, fbgemm_optim = OPTIMIZERS[optimizer]
    ours = SparseCoreEmbeddingBagCollection(tables, optim, kwargs, num_sparsecores=4, is_weighted=weighted)
    theirs = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        optimizer=fbgemm_optim,
        pooling_mode=PoolingMode.MEAN if mean else PoolingMode.SUM,
        learning_rate=kwargs["lr"],
        eps=kwargs.get("eps", 1e-8),
    )
    for w, t in zip(theirs.split_embedding_weights(), tables):
        w.data.copy_(ours.table_weight(t.name))
    return tables, ours, theirs


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dim", [8, 12, 64])
@pytest.mark.parametrize(
    "weighted,shared,mean",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, False), (False, False, True),
     (False, True, True)],
)  # fmt: skip
def test_direct_step_equals_fbgemm_cpu_bit_for_bit(optimizer, dim, weighted, shared, mean, monkeypatch):
    monkeypatch.delenv("TPUREC_NO_DIRECT", raising=False)
    tables, ours, theirs = _pair(optimizer, dim, weighted, shared, mean)
    assert direct.applies(ours.kernel)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        # hot steps: ~70 entries per row (long sums, where an order shows), else spread ids
        kjt = random_kjt(tables, 64, gen, max_len=6, weighted=weighted, hot_ids=step % 2 == 0)
        out = ours(kjt).values()
        want = theirs(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())
        assert torch.equal(out, want), f"step {step}: pooled outputs differ"
        upstream = torch.randn(out.shape, generator=gen)
        (out * upstream).sum().backward()
        (want * upstream).sum().backward()
        for w, t in zip(theirs.split_embedding_weights(), tables):
            got = ours.table_weight(t.name)
            assert torch.equal(got, w), f"step {step} table {t.name}: {int((got != w).sum())} elements differ"
    if optimizer != "sgd":
        state = ours.fused_optimizer.state_dict()["state"]
        for s, t in zip(theirs.split_optimizer_states(), tables):
            ours_state = state[f"embedding_bags.{t.name}.weight"][f"{t.name}.momentum1"]
            assert torch.equal(ours_state.flatten(), s[0].flatten())


def test_the_layout_path_differs_in_the_last_bit(monkeypatch):
    """The check above can fail: the layout path (the TPU's order) sums in another order, and
    FBGEMM's result is not reached by it on the same inputs."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    tables, ours, theirs = _pair("rowwise_adagrad", 64, False, False, False)
    assert not direct.applies(ours.kernel)
    gen = torch.Generator().manual_seed(3)
    kjt = random_kjt(tables, 64, gen, max_len=6, hot_ids=True)
    out = ours(kjt).values()
    want = theirs(kjt.values(), kjt.offsets())
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    w = theirs.split_embedding_weights()[0]
    torch.testing.assert_close(ours.table_weight("a"), w, rtol=0, atol=1e-6)
    assert not torch.equal(ours.table_weight("a"), w)
