"""Weight decay as FBGEMM's fused kernels apply it (tpurec/embedding/optimizers/weight_decay.py).

Oracles: FBGEMM's CPU TBE for row-wise Adagrad (L2, DECOUPLE); for Adam (FBGEMM's decays decoupled
and has no CPU kernel) torch.optim.AdamW, in tests/embedding/test_fused_updates.py. FBGEMM's CPU
row-wise Adagrad applies the decay only on its generic path: its fast path for an FP32 table read by
one feature passes weight_decay=0 to fbgemm's SparseAdaGrad kernel
(embedding_backward_split_cpu_template.cpp), silently. So the oracle reads every table through a
second, always empty feature, which puts FBGEMM on the generic path without changing any bag.
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.optimizers.registry import spec_from_torch
from tpurec.emulation import torchtpu_ops as tpu_standin

from .helpers import assert_within_fp16_steps, random_kjt

TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=30, feature_names=["fa"]),
    EmbeddingBagConfig(name="b", embedding_dim=12, num_embeddings=7, feature_names=["fb"]),
    EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=100, feature_names=["fc"]),
]
BATCH = 16


def _fbgemm_generic_path_tbe(mode, **kw):
    """One FBGEMM table per table, each read by its feature and an empty second one (generic path)."""
    specs = [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in TABLES]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=[i for i in range(len(TABLES)) for _ in range(2)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        pooling_mode=PoolingMode.SUM,
        weight_decay_mode=mode,
        **kw,
    )


def _with_empty_features(kjt):
    """TBE inputs with an empty bag set after each feature; the output columns of the real ones."""
    lengths = kjt.lengths().view(len(TABLES), BATCH)
    both = torch.stack([lengths, torch.zeros_like(lengths)], 1).reshape(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(both, 0)])
    cols, c = [], 0
    for t in TABLES:
        cols += list(range(c, c + t.embedding_dim))
        c += 2 * t.embedding_dim
    return kjt.values(), offsets, torch.tensor(cols)


@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
@pytest.mark.parametrize("layout", ["plain", "padded", "passes"])
def test_rowwise_adagrad_weight_decay_equals_fbgemm(mode, layout):
    kwargs = {"lr": 0.3, "eps": 1e-4, "weight_decay": 0.05, "weight_decay_mode": getattr(WeightDecayMode, mode)}
    extra = {"padded": {"pad_dims": True}, "passes": {"max_ids_per_partition": 8}}.get(layout, {})
    sc = SparseCoreEmbeddingBagCollection(TABLES, RowWiseAdagrad, kwargs, num_sparsecores=4, **extra)
    tbe = _fbgemm_generic_path_tbe(getattr(WeightDecayMode, mode), learning_rate=0.3, eps=1e-4, weight_decay=0.05)
    plain = _fbgemm_generic_path_tbe(WeightDecayMode.NONE, learning_rate=0.3, eps=1e-4)
    for m in (tbe, plain):
        for w, t in zip(m.split_embedding_weights(), TABLES):
            w.data.copy_(sc.table_weight(t.name))
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        kjt = random_kjt(TABLES, BATCH, gen, max_len=6, hot_ids=step % 2 == 0)
        ours = sc(kjt).values()
        values, offsets, cols = _with_empty_features(kjt)
        upstream = torch.randn(ours.shape, generator=gen)
        (ours * upstream).sum().backward()
        for m in (tbe, plain):
            theirs = m(values, offsets)
            if m is tbe:
                torch.testing.assert_close(ours, theirs[:, cols], rtol=1e-5, atol=1e-6)
            full = torch.zeros_like(theirs)
            full[:, cols] = upstream
            (theirs * full).sum().backward()
    if layout == "passes":
        assert sc.kernel.multipass_batches > 0, "no batch went over the limits"
    for w, p, t in zip(tbe.split_embedding_weights(), plain.split_embedding_weights(), TABLES):
        # atol: 2 ulps of the update's intermediates (magnitude ~1): a weight that cancels to ~6e-5 keeps
        # their rounding (1.1e-7 apart from FBGEMM's seen with the tables' random start of one test order)
        torch.testing.assert_close(sc.table_weight(t.name), w, rtol=1e-5, atol=2.5e-7)
        assert (w - p).abs().max() > 1e-3, "the decay made no difference: the oracle did not apply it"
    state = sc.fused_optimizer.state_dict()["state"]
    for s, t in zip(tbe.get_optimizer_state(), TABLES):
        ours = state[f"embedding_bags.{t.name}.weight"][f"{t.name}.momentum1"]
        torch.testing.assert_close(ours, s["sum"].view_as(ours), rtol=1e-5, atol=1e-7)


def test_adam_weight_decay_is_decoupled_in_modes_none_and_decouple():
    """FBGEMM's Adam decays decoupled whatever the mode; tpurec takes NONE and DECOUPLE as that (the
    update against torch's AdamW: tests/embedding/test_fused_updates.py)."""
    plain = spec_from_torch(torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.5})
    named = spec_from_torch(torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.5, "weight_decay_mode": "DECOUPLE"})
    assert plain == named and plain.weight_decay_mode == "DECOUPLE" and plain.weight_decay == 0.5


def test_untouched_rows_do_not_decay():
    """As FBGEMM's: the decay acts on the rows of the batch only."""
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=40, feature_names=["f"])]
    kwargs = {"lr": 0.1, "weight_decay": 0.5, "weight_decay_mode": "DECOUPLE"}
    sc = SparseCoreEmbeddingBagCollection(tables, RowWiseAdagrad, kwargs, num_sparsecores=4)
    before = sc.table_weight("t").clone()
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([3, 17, 17]), lengths=torch.tensor([2, 1]))
    sc(kjt).values().sum().backward()
    changed = (sc.table_weight("t") != before).any(1).nonzero().flatten().tolist()
    assert changed == [3, 17]


@pytest.mark.parametrize(
    "optimizer, kwargs, message",
    [
        (
            torch.optim.SGD,
            {"lr": 0.1, "weight_decay": 0.01},
            "SGD: weight_decay=0.01 is not supported .*EXACT_SGD has no",
        ),
        (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01}, "Adagrad: weight_decay=0.01 is not supported"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01}, "mode NONE .*supported: weight_decay_mode L2 or DECOUPLE"),
        (
            RowWiseAdagrad,
            {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.COUNTER},
            "weight_decay_mode=COUNTER is not supported .*per-row counters",
        ),
        (
            RowWiseAdagrad,
            {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.DECOUPLE_GLOBAL},
            "weight_decay_mode=DECOUPLE_GLOBAL is not supported",
        ),
        (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": "L2"}, "decays decoupled"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": "l3"}, "not one of FBGEMM's"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": -1.0, "weight_decay_mode": "L2"}, "weight_decay=-1.0 must be"),
    ],
)
def test_weight_decay_fbgemm_would_not_apply_is_refused_by_name(optimizer, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        SparseCoreEmbeddingBagCollection(TABLES, optimizer, kwargs, num_sparsecores=4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "optimizer, kwargs",
    [
        (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": "L2"}),
        (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": "DECOUPLE"}),
        (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
    ],
)
def test_weight_decay_through_the_torchtpu_adapter_equals_the_reference(optimizer, kwargs):
    """The TPU path (TorchTPU's ops, which take no weight decay: the row gathered into its slot's
    gradient, or the rows scaled before the op) run through the stand-in, against the CPU reference
    (which decays the rows it has at hand, no layout)."""

    def train(model):
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            out = model(random_kjt(TABLES, BATCH, gen, max_len=6, hot_ids=step % 2 == 1)).values()
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
        return {t.name: model.table_weight(t.name).clone() for t in TABLES}

    def model():
        torch.manual_seed(0)
        return SparseCoreEmbeddingBagCollection(TABLES, optimizer, kwargs, num_sparsecores=4, fixed_limits=True)

    want = train(model())
    standin = tpu_standin.install(sparsecores=4)
    with tpu_standin.adapter_on_cpu():
        got = train(model())
    assert standin.calls, "the adapter never reached TorchTPU's ops"
    # The CPU reference decays each row as it updates it; the TPU path gathers the rows' gradients
    # into slots first: float32 additions in another order, nothing more.
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-7)


def test_weight_decay_with_id_dropping_is_refused():
    kwargs = {"lr": 0.1, "weight_decay": 0.01, "weight_decay_mode": "L2"}
    with pytest.raises(ValueError, match="allow_id_dropping=True with weight decay .L2. is not supported"):
        SparseCoreEmbeddingBagCollection(TABLES, RowWiseAdagrad, kwargs, num_sparsecores=4, allow_id_dropping=True)


@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
def test_weight_decay_compiles_one_program_per_stack_and_op_on_the_tpu_path(mode):
    """One update program per stack whether a batch is within its limits or over them (L2's has its
    own shapes, fixed by the limits); a batch over its limits runs in more passes of those shapes
    (the decay's own gather/scale are plain device ops: tests/embedding/test_fixed_programs_on_device.py)."""
    kwargs = {"lr": 0.2, "weight_decay": 0.1, "weight_decay_mode": mode}
    standin = tpu_standin.install(sparsecores=4)
    model = SparseCoreEmbeddingBagCollection(TABLES, RowWiseAdagrad, kwargs, num_sparsecores=4, fixed_limits=True)
    gen = torch.Generator().manual_seed(7)
    with tpu_standin.adapter_on_cpu():
        for step in range(12):
            out = model(random_kjt(TABLES, BATCH, gen, max_len=8 if step % 3 == 1 else 3)).values()
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
    keys = standin.compile_keys()
    stacks = len(model.kernel.stacks)
    # Decoupled: the ordinary update after a row scale. L2: the update with one more entry per row
    # (its own shapes, fixed by the limits), within the limits and in every pass over them alike.
    assert len([k for k in keys if k[0] != "_sparse_dense_matmul"]) == stacks, sorted(keys)
    assert len([k for k in keys if k[0] == "_sparse_dense_matmul"]) == stacks, sorted(keys)
    assert model.kernel.multipass_batches > 0  # some batch went over the limits the first fixed


@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
def test_rowwise_adagrad_weight_decay_on_fp16_tables_is_fbgemms_within_one_fp16_step(mode):
    """FP16 tables (FBGEMM's generic path either way): computed in float32, rounded to FP16. FBGEMM
    rounds `correction * w - multiplier * g` once. L2 here rounds once too; decoupled decay rounds
    the scaled row, then the step (the op reads an FP16 table), so weights differ by about one FP16
    step at the table's magnitude (on a TPU FP16 tables are float32: docs/tpu.md)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.modules.embedding_configs import DataType

    tables = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=t.feature_names,
            data_type=DataType.FP16,
        )
        for t in TABLES
    ]
    kwargs = {"lr": 0.3, "eps": 1e-4, "weight_decay": 0.05, "weight_decay_mode": mode}
    sc = SparseCoreEmbeddingBagCollection(tables, RowWiseAdagrad, kwargs, num_sparsecores=4)
    tbe = _fbgemm_generic_path_tbe(
        getattr(WeightDecayMode, mode),
        learning_rate=0.3,
        eps=1e-4,
        weight_decay=0.05,
        weights_precision=SparseType.FP16,
    )
    for w, t in zip(tbe.split_embedding_weights(), tables):
        w.data.copy_(sc.table_weight(t.name))
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        kjt = random_kjt(tables, BATCH, gen, max_len=6, hot_ids=step % 2 == 0)
        ours = sc(kjt).values()
        values, offsets, cols = _with_empty_features(kjt)
        upstream = torch.randn(ours.shape, generator=gen)
        (ours * upstream).sum().backward()
        theirs = tbe(values, offsets)
        full = torch.zeros_like(theirs)
        full[:, cols] = upstream
        (theirs * full).sum().backward()
    for w, t in zip(tbe.split_embedding_weights(), tables):
        assert sc.table_weight(t.name).dtype == torch.float16
        got = sc.table_weight(t.name)
        if mode == "L2":  # one rounding, as FBGEMM
            assert_within_fp16_steps(got, w, steps=1, rare=0.01)
        else:  # two roundings (the scaled row, then the step): an FP16 step at the table's scale
            spacing = 2.0 ** (torch.floor(torch.log2(w.float().abs().max())) - 10)
            assert float((got.float() - w.float()).abs().max()) <= 2 * spacing
