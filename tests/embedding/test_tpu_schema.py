"""tpurec/embedding/tpu.py against TorchTPU's real `torch.ops.tpu.*` schemas, without a TPU.

Runs only where torch_tpu (and libtpu) can be imported in this interpreter, i.e. the separate venv
made by scripts/tpu_schema_env.sh; skipped everywhere else (see docs/tpu_schema_check.md).

With TORCH_DEVICE_BACKEND_AUTOLOAD=0 and TPU_SKIP_MDS_QUERY=1, `import torch_tpu` on a CPU-only host
registers the `tpu::` schemas with PrivateUse1 and Meta kernels (and a CPU-runnable
CompositeImplicitAutograd `preprocess_sparse_dense_matmul_input`) without touching a device. So:

* the schemas are pinned (names, order, types) to what the adapter was written for;
* the adapter's calls are recorded and bound to the real schemas by name, so two arguments of the
  same type passed in swapped positions are caught too (the dispatcher would only catch types);
* the adapter functions run end to end on meta tensors through the real Meta kernels, and the
  lookup's output matches tpurec's own fake kernel;
* TorchTPU's CPU preprocessing, called through the adapter, agrees with tpurec.embedding.preprocess.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.torchtpu_venv import skip_reason  # noqa: E402

_PROBE = "import torch, torch_tpu; torch.ops.tpu._sparse_dense_matmul.default"


_reason = skip_reason(_PROBE)
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_tpu  # noqa: E402, F401  (registers the tpu:: ops)

from tpurec.embedding import ops, tpu  # noqa: E402
from tpurec.embedding.constraints import coo_entries_per_sc, round_up  # noqa: E402
from tpurec.embedding.optimizers import adagrad, adam, sgd  # noqa: E402
from tpurec.embedding.preprocess import preprocess  # noqa: E402

from .jte_oracle import as_numpy, random_batch  # noqa: E402

# TorchTPU 0.2.0, as printed by `torch.ops.tpu.<op>.default._schema` (identical to the docstrings
# of torch_tpu/_internal/ops/ops.py). tpu.py is written against exactly these.
EXPECTED_SCHEMAS = {
    "_sparse_dense_matmul": (
        "tpu::_sparse_dense_matmul(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
        "Tensor gains, Tensor embedding_table, int device_batch_size, int max_ids_per_partition, "
        "int max_unique_ids_per_partition) -> Tensor"
    ),
    "_sparse_dense_matmul_grad_with_sgd": (
        "tpu::_sparse_dense_matmul_grad_with_sgd(Tensor row_pointers, Tensor embedding_ids, "
        "Tensor sample_ids, Tensor gains, Tensor embedding_table, Tensor activations_grad, "
        "Tensor learning_rate, int device_batch_size, int max_ids_per_partition, "
        "int max_unique_ids_per_partition, str computation_name) -> Tensor"
    ),
    "_sparse_dense_matmul_grad_with_adagrad": (
        "tpu::_sparse_dense_matmul_grad_with_adagrad(Tensor row_pointers, Tensor embedding_ids, "
        "Tensor sample_ids, Tensor gains, Tensor embedding_table, Tensor accumulator, "
        "Tensor activations_grad, Tensor learning_rate, float epsilon, int device_batch_size, "
        "int max_ids_per_partition, int max_unique_ids_per_partition, str computation_name) -> (Tensor, Tensor)"
    ),
    "_sparse_dense_matmul_grad_with_adam": (
        "tpu::_sparse_dense_matmul_grad_with_adam(Tensor row_pointers, Tensor embedding_ids, "
        "Tensor sample_ids, Tensor gains, Tensor embedding_table, Tensor momentum, Tensor velocity, "
        "Tensor activations_grad, Tensor alpha_t, float beta_1, float beta_2, float epsilon, "
        "int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition, "
        "str computation_name) -> (Tensor, Tensor, Tensor)"
    ),
    "preprocess_sparse_dense_matmul_input": (
        "tpu::preprocess_sparse_dense_matmul_input(Tensor input_indices, Tensor input_offsets, "
        "int max_ids_per_partition, int max_unique_ids_per_partition, int suggested_coo_buffer_size, "
        "int batch_size, str combiner, int local_device_count, int global_device_count, "
        "int num_sc_per_device, bool allow_id_dropping, str table_name) -> Dict(str, Tensor)"
    ),
}
DEVICE_OPS = [n for n in EXPECTED_SCHEMAS if n.startswith("_sparse")]

# Distinct values, so that any two int or float arguments passed in each other's place show up.
B, ROWS, DIM, NUM_SC = 8, 40, 8, 2
MAX_IDS, MAX_UNIQ = 24, 16
LR, EPS, ALPHA_T, BETA_1, BETA_2, ADAM_EPS = 0.125, 1e-7, 0.0625, 0.875, 0.995, 3e-8


def _sig(schema) -> tuple[list[tuple[str, str]], list[str]]:
    return [(a.name, str(a.type)) for a in schema.arguments], [str(r.type) for r in schema.returns]


@pytest.mark.parametrize("name", list(EXPECTED_SCHEMAS))
def test_real_schema_is_the_one_the_adapter_targets(name):
    op = getattr(torch.ops.tpu, name)
    assert op.overloads() == ["default"]
    real, expected = op.default._schema, torch._C.parse_schema(EXPECTED_SCHEMAS[name])
    assert _sig(real) == _sig(expected), f"TorchTPU's schema changed:\n  real:     {real}\n  expected: {expected}"


@pytest.mark.parametrize("name", DEVICE_OPS)
def test_device_ops_have_meta_and_privateuse1_kernels(name):
    for key in ("Meta", "PrivateUse1"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tpu::{name}", key), (name, key)


# ------------------------------------------------------------------- what tpu.py passes, by name
class _Recorder:
    """Stands in for torch.ops.tpu: records each call, runs the real op (on meta copies of the device
    tensors: the real schema parses the arguments and the Meta kernel runs), returns CPU zeros of the
    real output's shape and dtype so that the adapter's copy_ back into CPU state works."""

    def __init__(self, real_namespace):
        self.real = real_namespace
        self.calls: list[tuple[str, object, tuple, dict, object]] = []

    def __getattr__(self, name):
        real_op = getattr(self.real, name)

        def call(*args, **kwargs):
            if name.startswith("preprocess"):  # host-side op: runs for real on CPU
                out = real_op(*args, **kwargs)
            else:
                meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
                real_out = real_op(*meta, **kwargs)
                out = (
                    tuple(torch.zeros(o.shape, dtype=o.dtype) for o in real_out)
                    if isinstance(real_out, (tuple, list))
                    else torch.zeros(real_out.shape, dtype=real_out.dtype)
                )
            self.calls.append((name, real_op.default._schema, args, kwargs, out))
            return out

        return call


def _bind(schema, args, kwargs) -> dict:
    names = [a.name for a in schema.arguments]
    assert len(args) <= len(names), f"{len(args)} positional arguments for {schema}"
    assert not set(kwargs) - set(names), f"unknown keywords {set(kwargs) - set(names)} for {schema}"
    bound = dict(zip(names, args))
    bound.update(kwargs)
    assert set(bound) == set(names), f"missing {set(names) - set(bound)} for {schema}"
    return bound


class _Scalar:
    """Expected: a 0-dim float32 tensor holding this value (TorchTPU's learning rates are tensors)."""

    def __init__(self, value):
        self.value = value


def _check_bound(bound: dict, expected: dict, schema) -> None:
    assert set(expected) == set(bound), f"test does not cover {set(bound) ^ set(expected)}"
    for name, want in expected.items():
        got = bound[name]
        if isinstance(want, torch.Tensor):
            assert got is want, f"{schema.name}: argument {name!r} got the wrong tensor"
        elif isinstance(want, _Scalar):
            assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == torch.float32, (name, got)
            assert got.item() == pytest.approx(want.value), f"{schema.name}: {name}={got.item()} != {want.value}"
        elif isinstance(want, float):
            assert got == pytest.approx(want), f"{schema.name}: {name}={got!r} != {want!r}"
        else:
            assert type(got) is type(want) and got == want, f"{schema.name}: {name}={got!r} != {want!r}"


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder(torch.ops.tpu)
    monkeypatch.setattr(torch.ops, "tpu", rec)
    return rec


def _csr():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ROWS, (30,), generator=gen)
    sample = torch.randint(0, B, (30,), generator=gen)
    csr, _ = preprocess(
        ids,
        sample,
        torch.rand(30, generator=gen),
        device_batch_size=B,
        num_sc_per_device=NUM_SC,
        max_ids_per_partition=MAX_IDS,
        max_unique_ids_per_partition=MAX_UNIQ,
    )
    return csr


def _head(csr):
    return [csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains]


def _tail(csr):
    return [csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions, MAX_IDS, MAX_UNIQ]


def _common(csr, table):
    return dict(
        zip(("row_pointers", "embedding_ids", "sample_ids", "gains"), _head(csr)),
        embedding_table=table,
        device_batch_size=B,
        max_ids_per_partition=MAX_IDS,
        max_unique_ids_per_partition=MAX_UNIQ,
    )


def _only_call(recorder, name):
    assert [c[0] for c in recorder.calls] == [name], f"expected one call of tpu::{name}, got {recorder.calls}"
    return recorder.calls[0]


def test_lookup_arguments_by_name(recorder):
    csr, table = _csr(), torch.randn(ROWS, DIM)
    out = tpu.lookup(*_head(csr), table, *_tail(csr))
    _, schema, args, kwargs, _ = _only_call(recorder, "_sparse_dense_matmul")
    _check_bound(_bind(schema, args, kwargs), _common(csr, table), schema)
    assert out.shape == (B, DIM) and out.dtype == torch.float32


def test_sgd_arguments_by_name(recorder):
    csr, table, grad = _csr(), torch.randn(ROWS, DIM), torch.randn(B, DIM)
    sgd.tpu_update(*_head(csr), table, grad, LR, *_tail(csr))
    _, schema, args, kwargs, out = _only_call(recorder, "_sparse_dense_matmul_grad_with_sgd")
    _check_bound(
        _bind(schema, args, kwargs),
        dict(_common(csr, table), activations_grad=grad, learning_rate=_Scalar(LR), computation_name="tpurec_sgd"),
        schema,
    )
    assert out.shape == table.shape  # what the adapter copies back


@pytest.mark.parametrize("acc_shape", [(ROWS,), (ROWS, DIM)], ids=["rowwise", "elementwise"])
def test_adagrad_arguments_by_name(recorder, acc_shape):
    csr, table, grad, acc = _csr(), torch.randn(ROWS, DIM), torch.randn(B, DIM), torch.zeros(acc_shape)
    adagrad.tpu_update(*_head(csr), table, acc, grad, LR, EPS, *_tail(csr))
    _, schema, args, kwargs, out = _only_call(recorder, "_sparse_dense_matmul_grad_with_adagrad")
    _check_bound(
        _bind(schema, args, kwargs),
        dict(
            _common(csr, table),
            accumulator=acc,
            activations_grad=grad,
            learning_rate=_Scalar(LR),
            epsilon=EPS,
            computation_name="tpurec_adagrad",
        ),
        schema,
    )
    assert [o.shape for o in out] == [table.shape, acc.shape]


def test_adam_arguments_by_name(recorder):
    csr, table, grad = _csr(), torch.randn(ROWS, DIM), torch.randn(B, DIM)
    m, v = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    adam.tpu_update(*_head(csr), table, m, v, grad, ALPHA_T, BETA_1, BETA_2, ADAM_EPS, *_tail(csr))
    _, schema, args, kwargs, out = _only_call(recorder, "_sparse_dense_matmul_grad_with_adam")
    _check_bound(
        _bind(schema, args, kwargs),
        dict(
            _common(csr, table),
            momentum=m,
            velocity=v,
            activations_grad=grad,
            alpha_t=_Scalar(ALPHA_T),
            beta_1=BETA_1,
            beta_2=BETA_2,
            epsilon=ADAM_EPS,
            computation_name="tpurec_adam",
        ),
        schema,
    )
    assert [o.shape for o in out] == [table.shape, m.shape, v.shape]


def test_preprocess_arguments_by_name(recorder):
    ids = torch.tensor([0, 5, 7, 5, 2, 9, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 5, 7], dtype=torch.int32)
    tpu.preprocess_with_torch_tpu(
        ids,
        offsets,
        max_ids_per_partition=MAX_IDS,
        max_unique_ids_per_partition=MAX_UNIQ,
        batch_size=4,
        combiner="mean",
        num_sc_per_device=NUM_SC,
        allow_id_dropping=False,
        table_name="t0",
    )
    _, schema, args, kwargs, _ = _only_call(recorder, "preprocess_sparse_dense_matmul_input")
    _check_bound(
        _bind(schema, args, kwargs),
        dict(
            input_indices=ids,
            input_offsets=offsets,
            max_ids_per_partition=MAX_IDS,
            max_unique_ids_per_partition=MAX_UNIQ,
            suggested_coo_buffer_size=NUM_SC * coo_entries_per_sc(MAX_IDS, NUM_SC),
            batch_size=4,
            combiner="mean",
            local_device_count=1,
            global_device_count=1,
            num_sc_per_device=NUM_SC,
            allow_id_dropping=False,
            table_name="t0",
        ),
        schema,
    )


# ------------------------------------------------------------ the adapter on meta, no recorder
def _meta(t):
    return t.to("meta")


def test_adapter_runs_on_meta_through_the_real_meta_kernels():
    csr = _csr()
    head, tail = [_meta(t) for t in _head(csr)], _tail(csr)
    table, grad = torch.empty(ROWS, DIM, device="meta"), torch.empty(B, DIM, device="meta")
    out = tpu.lookup(*head, table, *tail)
    fake = torch.ops.tpurec.sparse_dense_matmul(*head, table, *tail)  # tpurec's own fake kernel
    assert out.device.type == "meta"
    assert (out.shape, out.dtype) == (fake.shape, fake.dtype) == ((B, DIM), torch.float32)
    sgd.tpu_update(*head, table, grad, LR, *tail)
    adagrad.tpu_update(*head, table, torch.empty(ROWS, device="meta"), grad, LR, EPS, *tail)
    adagrad.tpu_update(*head, table, torch.empty(ROWS, DIM, device="meta"), grad, LR, EPS, *tail)
    adam.tpu_update(
        *head, table, torch.empty_like(table), torch.empty_like(table), grad, ALPHA_T, BETA_1, BETA_2, ADAM_EPS, *tail
    )


def test_meta_kernels_reject_a_python_float_learning_rate():
    """The dispatcher enforces types: the reason the TPU calls wrap learning rates in tensors."""
    head = [_meta(t) for t in _head(_csr())]
    table = torch.empty(ROWS, DIM, device="meta")
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'learning_rate'"):
        torch.ops.tpu._sparse_dense_matmul_grad_with_sgd(
            *head, table, torch.empty(B, DIM, device="meta"), LR, B, MAX_IDS, MAX_UNIQ, "x"
        )


def test_register_puts_privateuse1_kernels_on_the_tpurec_ops():
    tpu.register(tpu.sparsecore_kernels())
    for op in tpu.sparsecore_kernels():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, "PrivateUse1"), op._qualname
    assert set(tpu.sparsecore_kernels()) == {ops.sparse_dense_matmul, sgd.op, adagrad.op, adam.op}


# ------------------------------------------------ TorchTPU's host preprocessing against tpurec's
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_torch_tpu_preprocessing_agrees_with_tpurec(combiner):
    """Row pointers equal; ids, samples and gains equal on the slots TorchTPU writes (it leaves the
    rest of its COO buffer uninitialised, like jax-tpu-embedding's C++ path).

    Limits are kept >= 8: TorchTPU aborts the process (absl CHECK) when a limit is exceeded without
    allow_id_dropping, or when the COO buffer it derives from the limits is 0 (e.g. limits of 0).
    """
    for seed in range(12):
        rng = np.random.default_rng(seed)
        num_sc = int(rng.choice([1, 2, 4]))
        batch_size = num_sc * int(rng.integers(1, 6))
        batch = random_batch(
            rng, batch_size, vocab=int(rng.choice([8, 37, 500])), max_bag=int(rng.integers(1, 6)), weights="ones"
        )
        ids, sample, _ = batch.flat()
        lens = torch.bincount(sample, minlength=batch_size).float()
        gains = {"sum": torch.ones(ids.numel()), "mean": 1 / lens[sample], "sqrtn": lens[sample].rsqrt()}[combiner]
        _, stats = preprocess(ids, sample, gains, device_batch_size=batch_size, num_sc_per_device=num_sc)
        max_ids = max(8, round_up(stats.max_ids_per_partition, 8))
        max_uniq = max(8, round_up(stats.max_unique_ids_per_partition, 8))
        ours, _ = preprocess(
            ids,
            sample,
            gains,
            device_batch_size=batch_size,
            num_sc_per_device=num_sc,
            max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max_uniq,
        )
        offsets = torch.cat([torch.zeros(1), lens.cumsum(0)]).int()
        theirs = tpu.preprocess_with_torch_tpu(
            ids.int(),
            offsets,
            max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max_uniq,
            batch_size=batch_size,
            combiner=combiner,
            num_sc_per_device=num_sc,
            allow_id_dropping=False,
            table_name="t",
        )
        o, t = as_numpy(ours), {k: v.numpy() for k, v in theirs.items()}
        ctx = f"seed {seed}, num_sc {num_sc}, batch {batch_size}"
        np.testing.assert_array_equal(o["row_pointers"], t["row_pointers"], err_msg=ctx)
        assert int(t["dropped_id_count"].sum()) == 0, ctx
        ours_slots, their_slots = o["embedding_ids"].size // num_sc, t["embedding_ids"].size // num_sc
        for sc, n in enumerate(o["row_pointers"].reshape(num_sc, -1)[:, -1].tolist()):
            a, b = slice(sc * ours_slots, sc * ours_slots + n), slice(sc * their_slots, sc * their_slots + n)
            for key in ("embedding_ids", "sample_ids"):
                np.testing.assert_array_equal(o[key][a], t[key][b], err_msg=f"{ctx}, sc {sc}: {key}")
            np.testing.assert_allclose(o["gains"][a], t["gains"][b], rtol=1e-6, err_msg=f"{ctx}, sc {sc}: gains")
        # The dict feeds the adapter's lookup as is (int32 CSR, float32 gains).
        table = torch.empty(512, 8, device="meta")
        out = tpu.lookup(
            *[_meta(theirs[k]) for k in ("row_pointers", "embedding_ids", "sample_ids", "gains")],
            table,
            batch_size,
            num_sc,
            num_sc,
            max_ids,
            max_uniq,
        )
        assert out.shape == (batch_size, 8)


def test_torch_tpu_preprocessing_keeps_more_than_128_ids():
    """TorchTPU's preprocessing with suggested_coo_buffer_size=0 keeps 128 entries and drops the rest
    silently; the adapter sizes the buffer from the limits, so 200 ids within them all arrive."""
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
    assert int(out["row_pointers"][0]) == 200
    kept = out["embedding_ids"][:200]
    assert sorted(kept.tolist()) == list(range(200))
