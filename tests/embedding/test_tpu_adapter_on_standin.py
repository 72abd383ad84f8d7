"""The real TPU adapter, run end to end on CPU through the TorchTPU stand-in (tpurec/emulation/torchtpu_ops.py).

What the meta-tensor schema check cannot show: that every argument the adapter passes means what
TorchTPU takes it to mean (the stand-in computes with TorchTPU's conventions), that a training run
compiles one program per stack and op ("no recompiles"), and that stacks carry distinct names.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.emulation import torchtpu_ops as tpu_standin

from .helpers import fused_optimizers

NUM_SC = 4
BATCH = 16
# Two dims -> two stacks; a MEAN table, a multi-feature table.
TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=97, feature_names=["fa"]),
    EmbeddingBagConfig(
        name="b", embedding_dim=16, num_embeddings=300, feature_names=["fb", "fc"], pooling=PoolingType.MEAN
    ),
    EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=50, feature_names=["fd"]),
]
ROWS = {"fa": 97, "fb": 300, "fc": 300, "fd": 50}


def _batch(gen, step):
    """Id distributions that change from step to step: uniform, hot (few ids), empty bags."""
    keys, values, lengths = list(ROWS), [], []
    for key in keys:
        lens = torch.randint(0, 4, (BATCH,), generator=gen)
        if step % 5 == 4:
            lens[: BATCH // 2] = 0  # half the bags empty
        n = int(lens.sum())
        if step % 3 == 1:  # hot partition: many distinct ids, all in partition 0 (id mod 4 == 0)
            lens = torch.randint(8, 14, (BATCH,), generator=gen)
            n = int(lens.sum())
            ids = torch.randint(0, ROWS[key] // NUM_SC, (n,), generator=gen) * NUM_SC
        else:
            ids = torch.randint(0, ROWS[key], (n,), generator=gen)
        values.append(ids)
        lengths.append(lens)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _model(name, **kw):
    optim, kwargs = fused_optimizers()[name]
    torch.manual_seed(0)
    return SparseCoreEmbeddingBagCollection(
        TABLES, optim, kwargs, num_sparsecores=NUM_SC, device="cpu", fixed_limits=True, **kw
    )


def _train(model, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps):
        out = model(_batch(gen, step)).values()
        outs.append(out.detach().clone())
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return outs


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_adapter_through_torchtpu_semantics_equals_the_reference(name):
    reference = _model(name, allow_id_dropping=True)
    ref_outs = _train(reference, 6)
    standin = tpu_standin.install(sparsecores=NUM_SC)
    adapted = _model(name, allow_id_dropping=True)
    with tpu_standin.adapter_on_cpu():
        outs = _train(adapted, 6)
    assert standin.calls, "the adapter never reached TorchTPU's ops"
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for t in ("a", "b", "c"):
        torch.testing.assert_close(adapted.table_weight(t), reference.table_weight(t), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_fifty_steps_compile_one_program_per_stack_and_op(name):
    standin = tpu_standin.install(sparsecores=NUM_SC)
    model = _model(name, allow_id_dropping=True)
    with tpu_standin.adapter_on_cpu():
        _train(model, 50, seed=7)
    stacks = len(model.kernel.stacks)
    assert stacks == 2
    keys = standin.compile_keys()
    lookups = [k for k in keys if k[0] == "_sparse_dense_matmul"]
    updates = [k for k in keys if k[0] != "_sparse_dense_matmul"]
    assert len(lookups) == stacks and len(updates) == stacks, sorted(keys.values())
    assert all(count == 50 for count in keys.values())
    # Hot-id batches overflow limits fixed from the first batch: ids are dropped and counted,
    # shapes never change.
    assert model.kernel.dropped_id_count > 0
    names = {k[1][-1] for k in updates}
    assert len(names) == stacks and all(n.startswith("tpurec_k") for n in names)


def test_two_kernels_never_share_a_computation_name():
    a, b = _model("sgd"), _model("sgd")
    names = a.kernel.computation_names + b.kernel.computation_names
    assert len(set(names)) == len(names) == 4


def test_a_batch_over_fixed_limits_without_dropping_runs_in_passes_of_the_same_programs():
    standin = tpu_standin.install(sparsecores=NUM_SC)
    model = _model("sgd")
    gen = torch.Generator().manual_seed(1)
    with tpu_standin.adapter_on_cpu():
        model(_batch(gen, 0)).values().sum().backward()  # limits fixed from this batch
        programs = set(standin.compile_keys())
        # 12 distinct ids per bag, all in partition 0: far over limits fixed from a uniform batch.
        hot = KeyedJaggedTensor(
            keys=list(ROWS), values=(torch.arange(12) * NUM_SC).repeat(4 * BATCH), lengths=torch.full((4 * BATCH,), 12)
        )
        model(hot).values().sum().backward()
    assert max(s.passes for s in model.id_stats().values()) > 1 and model.kernel.dropped_id_count == 0
    assert set(standin.compile_keys()) == programs  # the passes reused the step's programs


def test_limits_given_are_fixed_and_8_aligned():
    model = _model("sgd", max_ids_per_partition=13, max_unique_ids_per_partition=5)
    assert [model.kernel.stack_limits(i) for i in range(2)] == [(16, 8), (16, 8)]


class _DeviceOnly(torch.Tensor):
    """A tensor that, like one on a TPU, must be copied to the host before host code reads it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)  # a property getter's descriptor
        if owner is torch.Tensor.device:
            return torch.device("meta")  # anything but cpu
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        if owner in (torch.Tensor.dtype, torch.Tensor.shape) or func in (
            torch.Tensor.__repr__,
            torch.Tensor.dim,
            torch.Tensor.numel,
            torch.Tensor.size,
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise AssertionError(f"host code used a device tensor directly: {getattr(func, '__name__', func)}")


def test_preprocessing_copies_device_ids_to_the_host_first():
    model = SparseCoreEmbeddingBagCollection(TABLES, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=NUM_SC, device="cpu")
    kjt = _batch(torch.Generator().manual_seed(3), 0)
    want = model.kernel.preprocess(kjt)
    on_device = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values().as_subclass(_DeviceOnly), lengths=kjt.lengths().as_subclass(_DeviceOnly)
    )
    got = model.kernel.preprocess(on_device)
    for a, b in zip(got, want):
        assert torch.equal(a.row_pointers, b.row_pointers) and torch.equal(a.embedding_ids, b.embedding_ids)


def test_torchtpu_preprocessing_gets_a_buffer_for_every_id():
    """With suggested_coo_buffer_size=0 TorchTPU keeps 128 entries and drops the rest silently; the
    adapter sizes the buffer from the limits, so 200 ids within the limits all arrive."""
    from tpurec.embedding import tpu

    standin = tpu_standin.install(sparsecores=1)
    ids = torch.arange(200, dtype=torch.int32)
    offsets = torch.tensor([0, 100, 200], dtype=torch.int32)
    out = tpu.preprocess_with_torch_tpu(
        ids,
        offsets,
        max_ids_per_partition=256,
        max_unique_ids_per_partition=256,
        batch_size=2,
        combiner="sum",
        num_sc_per_device=1,
        allow_id_dropping=False,
        table_name="t",
    )
    assert int(out["dropped_id_count"].sum()) == 0
    ((_, key),) = standin.calls
    assert key[4] == 256  # suggested_coo_buffer_size


@pytest.mark.parametrize("num_sc", [2, 4])
def test_torchtpu_coo_buffer_is_read_per_device_at_several_sparsecores(num_sc):
    """TorchTPU takes suggested_coo_buffer_size for the whole device (jax-tpu-embedding's
    ComputeCooBufferSizePerDevice in its binary), split over its SparseCores: the buffers it returns
    are that long in all, and every id within the limits arrives, at S = 2 and 4 (at S = 1 a
    per-SparseCore reading cannot be told apart)."""
    from tpurec.embedding import tpu
    from tpurec.embedding.constraints import coo_entries_per_sc

    tpu_standin.install(sparsecores=num_sc)
    ids = torch.arange(400, dtype=torch.int32)
    offsets = torch.arange(0, 401, 50, dtype=torch.int32)  # 8 samples of 50 ids
    out = tpu.preprocess_with_torch_tpu(
        ids,
        offsets,
        max_ids_per_partition=128,
        max_unique_ids_per_partition=128,
        batch_size=8,
        combiner="sum",
        num_sc_per_device=num_sc,
        allow_id_dropping=False,
        table_name="t",
    )
    assert out["embedding_ids"].numel() == num_sc * coo_entries_per_sc(128, num_sc)
    assert int(out["dropped_id_count"].sum()) == 0
    kept = out["embedding_ids"][out["embedding_ids"] != 2**31 - 1]
    assert kept.numel() == 400
    # Read per device, 0 means 128 entries in all: 400 ids cannot fit, and the rest is dropped silently.
    small = torch.ops.tpu.preprocess_sparse_dense_matmul_input(
        ids, offsets, 128, 128, 0, 8, "sum", 1, 1, num_sc, False, "t"
    )
    assert small["embedding_ids"].numel() == 128
    assert int(small["dropped_id_count"].sum()) == 400 - int((small["embedding_ids"] != 2**31 - 1).sum())


def test_fp16_tables_are_widened_to_fp32_for_torchtpu_with_one_warning():
    import warnings

    from torchrec.modules.embedding_configs import DataType

    from tpurec.embedding import dtypes

    fp16 = [type(t)(**{**t.__dict__, "data_type": DataType.FP16}) for t in TABLES]
    optim, kwargs = fused_optimizers()["rowwise_adagrad"]
    make = lambda tables, **kw: SparseCoreEmbeddingBagCollection(  # noqa: E731
        tables, optim, kwargs, num_sparsecores=NUM_SC, device="cpu", fixed_limits=True, allow_id_dropping=True, **kw
    )
    dtypes._WARNED.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        widened = make(fp16, widen_tables=True)  # what a tpu device does by default
        make(fp16, widen_tables=True)  # the same tables again: no second warning
    said = [str(w.message) for w in seen if "stored and trained as float32" in str(w.message)]
    assert len(said) == 1 and all(f"{n} (fp16)" in said[0] for n in ("a", "b", "c")), said
    assert {v.dtype for v in widened.state_dict().values()} == {torch.float32}
    # the same run with float32 tables from the same (fp16-valued) start is the reference
    reference = make(TABLES)
    reference.load_state_dict(widened.state_dict())
    ref_outs = _train(reference, 4)
    standin = tpu_standin.install(sparsecores=NUM_SC)
    with tpu_standin.adapter_on_cpu():
        outs = _train(widened, 4)
    assert {k[1][4][2] for k in standin.calls if k[0].startswith("_sparse")} == {"torch.float32"}
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # unwidened fp16 storage never reaches TorchTPU's ops (the stand-in refuses it, as jax-tpu-embedding does)
    native = make(fp16, widen_tables=False)
    with tpu_standin.adapter_on_cpu(), pytest.raises(RuntimeError, match="must be float32"):
        _train(native, 1)
