"""FP16 (and BF16) tables: stored in their dtype on CPU, trained like stock TorchRec's fused kernel.

Oracle: FBGEMM's CPU TBE with FP16 weights (what TorchRec's fused kernel runs): float32 output,
float32 optimizer state, each update computed in float32 and rounded once to FP16 (round to nearest
even: its `stochastic_rounding` flag is unused on CPU). tpurec's reference does the same.
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

from .helpers import assert_within_fp16_steps

DIMS = (8, 16, 8)


def _tables(data_type=DataType.FP16):
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=d, num_embeddings=40 + 7 * i, feature_names=[f"f{i}"], data_type=data_type
        )
        for i, d in enumerate(DIMS)
    ]


def _batch(gen, batch=8):
    tables = _tables()
    lengths = torch.randint(0, 5, (len(tables) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
            for t, n in zip(tables, lengths.view(len(tables), batch).sum(1))
        ]
    )
    return KeyedJaggedTensor(keys=[t.feature_names[0] for t in tables], values=values, lengths=lengths)


def _tbe(optim, kwargs):
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in _tables()],
        optimizer=optim,
        learning_rate=kwargs["lr"],
        eps=kwargs.get("eps", 1e-8),
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP16,
    )


def _train_both(fbgemm_optim, optim, kwargs, steps=4, seed=0):
    torch.manual_seed(seed)
    sc = SparseCoreEmbeddingBagCollection(_tables(), optim, kwargs, num_sparsecores=2)
    tbe = _tbe(fbgemm_optim, kwargs)
    with torch.no_grad():
        for w, t in zip(tbe.split_embedding_weights(), _tables()):
            w.copy_(sc.table_weight(t.name))
    gen = torch.Generator().manual_seed(3)
    outs = []
    for _ in range(steps):
        kjt = _batch(gen)
        upstream = torch.randn(8, sum(DIMS), generator=gen)
        ours, theirs = sc(kjt).values(), tbe(kjt.values(), kjt.offsets())
        outs.append((ours.detach().clone(), theirs.detach().clone()))
        (ours * upstream).sum().backward()
        (theirs * upstream).sum().backward()
    return sc, tbe, outs


def test_fp16_tables_are_stored_in_fp16_and_output_fp32_like_torchrec():
    sc = SparseCoreEmbeddingBagCollection(_tables(), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    assert {v.dtype for v in sc.state_dict().values()} == {torch.float16}
    assert all(sc.kernel.stack_weight(i).dtype == torch.float16 for i in range(len(sc.kernel.stacks)))
    ebc = EmbeddingBagCollection(_tables())  # stock TorchRec: fp16 parameters, fp32 output
    ebc.load_state_dict(sc.state_dict())
    kjt = _batch(torch.Generator().manual_seed(0))
    out = sc(kjt).values()
    assert out.dtype == ebc(kjt).values().dtype == torch.float32
    # The unsharded EBC sums in fp16 (nn.EmbeddingBag of fp16 weights) before its cast; the fused
    # kernel (FBGEMM, and tpurec) sums in float32: they differ by the fp16 rounding of the sum.
    torch.testing.assert_close(out, ebc(kjt).values(), rtol=2**-10, atol=2**-11)


def test_fp16_sgd_equals_fbgemm_fp16_exactly():
    sc, tbe, outs = _train_both(EmbOptimType.EXACT_SGD, torch.optim.SGD, {"lr": 0.3})
    for ours, theirs in outs:  # float32 sums of the same fp16 rows: equal up to summation order
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for w, t in zip(tbe.split_embedding_weights(), _tables()):
        # both compute fp32(w) - lr*g in float32 and round once to fp16: bit-equal
        torch.testing.assert_close(sc.table_weight(t.name), w, rtol=0, atol=0)


@pytest.mark.parametrize("fbgemm_optim", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD])
def test_fp16_adagrad_equals_fbgemm_fp16(fbgemm_optim):
    from torchrec.optim import RowWiseAdagrad

    rowwise = fbgemm_optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    optim = RowWiseAdagrad if rowwise else torch.optim.Adagrad
    sc, tbe, outs = _train_both(fbgemm_optim, optim, {"lr": 0.05, "eps": 1e-6}, steps=6)
    for ours, theirs in outs:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for w, t in zip(tbe.split_embedding_weights(), _tables()):
        mine = sc.table_weight(t.name)
        assert mine.dtype == torch.float16
        if rowwise:
            # FBGEMM sums g*g element by element, tpurec as a vector norm: the float32 row multiplier
            # may differ in its last bit, which moves an fp16 weight near a rounding tie by one fp16
            # step (3 of 22,560 weights over 15 seeds x 6 steps, each exactly one step).
            assert_within_fp16_steps(mine, w)
        else:
            torch.testing.assert_close(mine, w, rtol=0, atol=0)
    # optimizer state stays float32 for fp16 tables, in tpurec as in FBGEMM
    state = sc.fused_optimizer.state_dict()["state"]
    assert {s.dtype for entry in state.values() for s in entry.values()} == {torch.float32}
    for t, (want,) in zip(_tables(), tbe.split_optimizer_states()):
        assert want.dtype == torch.float32
        got = sc.kernel.read_state(t.name, "momentum1")
        torch.testing.assert_close(got.flatten(), want.flatten(), rtol=1e-5, atol=1e-9)


def test_fp16_state_dict_is_a_view_and_loads_stock_torchrec_fp16_state():
    sc = SparseCoreEmbeddingBagCollection(_tables(), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    sd = sc.state_dict()
    sd["embedding_bags.t1.weight"][3].fill_(0.25)  # in place, as DCP loads
    assert torch.all(sc.table_weight("t1")[3] == 0.25)
    stock = EmbeddingBagCollection(_tables())
    sc.load_state_dict(stock.state_dict())
    for t in _tables():
        assert torch.equal(sc.table_weight(t.name), stock.state_dict()[f"embedding_bags.{t.name}.weight"])


def test_bf16_tables_are_stored_in_bf16_and_rounded_as_fp16_ones():
    sc = SparseCoreEmbeddingBagCollection(_tables(DataType.BF16), torch.optim.SGD, {"lr": 0.5}, num_sparsecores=2)
    before = {t.name: sc.table_weight(t.name).clone() for t in _tables()}
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    upstream = torch.linspace(-1, 1, sum(DIMS)).unsqueeze(0)
    (sc(kjt).values() * upstream).sum().backward()
    for k, (name, row) in enumerate(zip(("t0", "t1", "t2"), (1, 2, 3))):
        g = upstream[0, sum(DIMS[:k]) : sum(DIMS[: k + 1])]
        # SGD's FBGEMM rounding (no oracle: FBGEMM's CPU TBE has no BF16 forward)
        step = (-0.5 * g).to(torch.bfloat16).float()
        want = (before[name][row].float() + step).to(torch.bfloat16)
        assert sc.table_weight(name).dtype == torch.bfloat16
        assert torch.equal(sc.table_weight(name)[row], want)


def test_quantized_tables_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="INT8 is not trainable.*inference"):
        SparseCoreEmbeddingBagCollection(_tables(DataType.INT8), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
