"""The direct CPU step (`tpurec.embedding.direct`) gives the layout path's numbers, and the layout path
still runs wherever the SparseCore layout is the thing exercised (limits, the stand-in, padding)."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.embedding.helpers import fused_optimizers, make_tables, random_kjt
from tpurec.embedding import csr_build, direct
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.optimizers.adagrad import AdagradSpec

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed")

OPTIMIZERS = fused_optimizers()


def _pair(tables, name, weighted, **kw):
    """(direct, layout) modules with the same tables; the layout one switched to the layout path."""
    cls, kwargs = OPTIMIZERS[name]
    a = SparseCoreEmbeddingBagCollection(tables, cls, kwargs, num_sparsecores=4, is_weighted=weighted, **kw)
    b = SparseCoreEmbeddingBagCollection(tables, cls, kwargs, num_sparsecores=4, is_weighted=weighted, **kw)
    b.load_state_dict(a.state_dict())
    return a, b


def _step(model, kjt, grad, layout: bool, monkeypatch) -> torch.Tensor:
    if layout:
        monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    took_direct = direct.applies(model.kernel)
    out = model(kjt).values()
    out.backward(grad)
    monkeypatch.delenv("TPUREC_NO_DIRECT", raising=False)
    assert took_direct == (not layout)
    return out.detach()


def _assert_close(x, y):
    scale = max(float(y.abs().max()), 1e-6) if y.numel() else 1.0
    assert torch.allclose(x, y, rtol=0, atol=2e-6 * scale), float((x - y).abs().max())


def _assert_same_tables(a, b):
    for t in a.kernel.table_names:
        _assert_close(a.kernel.read_weight(t), b.kernel.read_weight(t))
        for s in a.kernel.optimizer.state_names:
            _assert_close(a.kernel.read_state(t, s), b.kernel.read_state(t, s))
        assert a.kernel.step_count(t) == b.kernel.step_count(t)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_direct_equals_layout_path(name, weighted, pooling, monkeypatch):
    # make_tables: two stacks (dims 8 and 16), t1 feeds two features, t3 has 5 rows; ragged bags
    # with empty ones and repeated ids, and a hot batch where a few rows take every id.
    tables = make_tables(pooling)
    a, b = _pair(tables, name, weighted)
    before = {t.name: a.kernel.read_weight(t.name).clone() for t in tables}
    gen = torch.Generator().manual_seed(len(name) * 3 + weighted)
    for step in range(3):
        kjt = random_kjt(tables, 6, gen, weighted=weighted, hot_ids=step == 1)
        grad = torch.randn(6, sum(t.embedding_dim * len(t.feature_names) for t in tables), generator=gen)
        _assert_close(_step(a, kjt, grad, False, monkeypatch), _step(b, kjt, grad, True, monkeypatch))
        _assert_same_tables(a, b)
    assert all(not torch.equal(a.kernel.read_weight(t), w) for t, w in before.items())  # they trained


DECAYED = {
    "rowwise_adagrad_l2": ("rowwise_adagrad", {"weight_decay": 0.05, "weight_decay_mode": "L2"}),
    "rowwise_adagrad_decouple": ("rowwise_adagrad", {"weight_decay": 0.05, "weight_decay_mode": "DECOUPLE"}),
    "adam_decoupled": ("adam", {"weight_decay": 0.05}),
}


@pytest.mark.parametrize("case", list(DECAYED))
def test_direct_weight_decay_equals_layout_path(case, monkeypatch):
    """The decayed update in the direct loops (direct_kernels.py) gives the layout path's numbers
    (optimizers/weight_decay.decay_rows), touched rows only; with an lr changed between steps, as a
    scheduler does (the decoupled scale is 1 - lr * weight_decay)."""
    name, decay = DECAYED[case]
    cls, kwargs = OPTIMIZERS[name]
    tables = make_tables()
    a = SparseCoreEmbeddingBagCollection(tables, cls, kwargs | decay, num_sparsecores=4)
    b = SparseCoreEmbeddingBagCollection(tables, cls, kwargs | decay, num_sparsecores=4)
    b.load_state_dict(a.state_dict())
    plain = SparseCoreEmbeddingBagCollection(tables, cls, kwargs, num_sparsecores=4)
    plain.load_state_dict(a.state_dict())
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        if step == 2:  # a scheduler's new lr, read at update time
            for m in (a, b, plain):
                for group in m.fused_optimizer.param_groups:
                    group["lr"] *= 0.5
        kjt = random_kjt(tables, 6, gen, hot_ids=step == 1)
        grad = torch.randn(6, sum(t.embedding_dim * len(t.feature_names) for t in tables), generator=gen)
        _assert_close(_step(a, kjt, grad, False, monkeypatch), _step(b, kjt, grad, True, monkeypatch))
        _assert_same_tables(a, b)
        _step(plain, kjt, grad, False, monkeypatch)
    # the decay acted: the decayed tables differ from the undecayed run's
    assert any(not torch.equal(a.kernel.read_weight(t.name), plain.kernel.read_weight(t.name)) for t in tables)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_direct_batch_zero_and_all_empty(name, monkeypatch):
    tables = make_tables()
    a, b = _pair(tables, name, False)
    keys = [f for t in tables for f in t.feature_names]
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    for batch in (0, 3):  # no samples; samples whose bags are all empty
        kjt = KeyedJaggedTensor(
            keys=keys, values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(len(keys) * batch, dtype=torch.long)
        )
        out = _step(a, kjt, torch.ones(batch, width), False, monkeypatch)
        assert out.shape == (batch, width) and not out.any()
        _step(b, kjt, torch.ones(batch, width), True, monkeypatch)
        _assert_same_tables(a, b)


# (Element-wise Adagrad's first step, g / (|g| + eps) with g summed from ~25 terms, amplifies the
# order of float32 additions where the terms cancel; its equality is checked on the batches above.)
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_direct_many_ids_and_large_keys(name, dtype, monkeypatch):
    """A batch with more ids than the table has rows (every row touched, 64-bit sort keys), ids
    int64 or int32 (the keys are shifted in 64 bits either way)."""
    tables = [EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=70_000, feature_names=["f"])]
    a, b = _pair(tables, name, True)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 60, (4000,), generator=gen, dtype=dtype)
    values = torch.randint(0, 70_000, (int(lengths.sum()),), generator=gen, dtype=dtype)
    kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths, weights=torch.rand(values.numel()))
    grad = torch.randn(4000, 4, generator=gen)
    _assert_close(_step(a, kjt, grad, False, monkeypatch), _step(b, kjt, grad, True, monkeypatch))
    _assert_same_tables(a, b)


def test_direct_id_stats_and_bad_ids(monkeypatch):
    tables = make_tables()
    a, b = _pair(tables, "rowwise_adagrad", False)
    kjt = random_kjt(tables, 5, torch.Generator().manual_seed(1))
    _step(a, kjt, torch.ones(5, 40), False, monkeypatch)
    _step(b, kjt, torch.ones(5, 40), True, monkeypatch)
    sa, sb = a.id_stats(), b.id_stats()
    assert sa.keys() == sb.keys() and len(sa) == 2
    for k in sa:
        assert torch.equal(sa[k].ids_per_partition, sb[k].ids_per_partition)
        assert sa[k].required_buffer_size_per_sc == sb[k].required_buffer_size_per_sc
    bad = KeyedJaggedTensor(
        keys=["f1", "f2", "f3", "f4"], values=torch.tensor([1, 2, 3, 99]), lengths=torch.tensor([1, 1, 1, 1])
    )
    with pytest.raises(IndexError, match="feature 'f4' \\(table 't3'\\): ids must be in \\[0, 5\\)"):
        a(bad)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_ids_per_partition": 64},  # given limits: a batch over them runs in passes
        {"fixed_limits": True},  # a TPU's fixed buffers (the dry run)
        {"id_limits": {"t1": (16, 16), "t2": (16, 16), "t3": (16, 16)}},
    ],
)
def test_layout_path_kept_where_the_layout_matters(kw):
    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec

    kt = [KernelTable(t.name, t.num_embeddings, t.embedding_dim, tuple(t.feature_names)) for t in make_tables()]
    assert direct.applies(SparseCoreKernel(kt, SGDSpec(lr=0.1), 4))
    kernel = SparseCoreKernel(kt, SGDSpec(lr=0.1), 4, **kw)
    assert not direct.applies(kernel)
    kernel(random_kjt(make_tables(), 4, torch.Generator().manual_seed(2)))
    assert kernel.inputs.stats_pending is None and kernel.last_stats  # built by preprocess, as before


def test_layout_path_on_the_standin_fp16_and_unknown_options(monkeypatch):
    from torchrec.modules.embedding_configs import DataType
    from torchrec.optim import RowWiseAdagrad

    from tpurec.emulation.torchtpu_ops import adapter_on_cpu

    tables = make_tables()
    m = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adagrad, {"lr": 0.1}, num_sparsecores=4)
    assert direct.applies(m.kernel)
    # an optimizer field the direct loops do not implement, set: refused rather than ignored
    monkeypatch.setattr(AdagradSpec, "direct_fields", frozenset({"lr", "initial_accumulator_value"}))
    assert not direct.applies(m.kernel)  # eps=1e-10 is on
    fp16 = [EmbeddingBagConfig(name="h", embedding_dim=8, num_embeddings=9, feature_names=["f"])]
    fp16[0].data_type = DataType.FP16
    h = SparseCoreEmbeddingBagCollection(fp16, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    assert not direct.applies(h.kernel)  # FP16 tables keep FBGEMM's rounding (the layout path's)
    decayed = SparseCoreEmbeddingBagCollection(
        tables, RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": "L2"}, num_sparsecores=4
    )
    assert direct.applies(decayed.kernel)  # weight decay: in the direct loops too (direct_kernels.py)
    odd = [EmbeddingBagConfig(name="o", embedding_dim=12, num_embeddings=9, feature_names=["f"])]
    assert direct.applies(SparseCoreEmbeddingBagCollection(odd, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2).kernel)
    padded = SparseCoreEmbeddingBagCollection(odd, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2, pad_dims=True)
    assert not direct.applies(padded.kernel)  # rows stored 16 wide, as on a SparseCore
    with adapter_on_cpu():  # the ops' CPU kernels replaced by the TorchTPU stand-in
        assert not direct.applies(padded.kernel) and not direct.applies(m.kernel)
        monkeypatch.undo()
        assert not direct.applies(m.kernel)


@pytest.mark.parametrize(
    "switch",
    [("TPUREC_NO_DIRECT", "1"), ("TPUREC_NO_NUMBA", "1"), ("TPUREC_EMULATE_TPU", "v5p-8")],  # the last: fixed limits
)
def test_the_kept_verdict_follows_switches_set_at_run_time(switch, monkeypatch):
    """applies() keeps its verdict per kernel; a variable set between two steps must still turn the
    direct step off for the next one, and on again once unset (the cheap reads of env_flags.py)."""
    m = SparseCoreEmbeddingBagCollection(make_tables(), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4)
    assert direct.applies(m.kernel) and direct.applies(m.kernel)
    monkeypatch.setenv(*switch)
    assert not direct.applies(m.kernel)
    monkeypatch.setenv(switch[0], "0" if switch[0] != "TPUREC_EMULATE_TPU" else "")
    assert direct.applies(m.kernel)
    monkeypatch.delenv(switch[0])
    assert direct.applies(m.kernel)


def test_a_kjt_out_of_stacked_order_takes_the_checked_general_route(monkeypatch):
    """host_parts' compiled pass serves a KJT in the kernel's stacked order; one in another key order
    (permuted by the general route, KernelInput.stack_arrays) gives the same output, and bad lengths
    raise check_kjt's messages."""
    from tpurec.errors import UserError

    tables = make_tables()
    m = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.0}, num_sparsecores=4)
    kjt = random_kjt(tables, 8, torch.Generator().manual_seed(3))
    order = m.kernel.inputs.stacked_order
    assert kjt.keys() != order  # f3 and f4 swap places in the stacks
    stacked = kjt.permute([kjt.keys().index(f) for f in order])
    with torch.no_grad():
        general = m(kjt).values()
        monkeypatch.setattr(type(m.kernel.inputs), "stack_arrays", None)  # the fast route must not need it
        assert torch.equal(m(stacked).values(), general)
    monkeypatch.undo()
    lengths = stacked.lengths().clone()
    lengths[0] += 1  # one id more than the values hold
    with pytest.raises(UserError, match="lengths sum to"):
        m(KeyedJaggedTensor(keys=order, values=stacked.values(), lengths=lengths))
    lengths[0] = -1  # a negative length (checked before the sum)
    with pytest.raises(UserError, match="negative length"):
        m(KeyedJaggedTensor(keys=order, values=stacked.values(), lengths=lengths))
