"""The TPU kernels of the TensorCore path (tensorcore/tpu_bridge.py), run on CPU through a stand-in
for TorchTPU's `jax_op` that does what the 0.2.0 bridge does (torch_tpu/_internal/pallas/pallas.py):
checks every argument is annotated, makes the non-array ones static, runs the function on the
tensors' buffers and hands back torch tensors. What this checks is the wiring: argument order,
the hyper-parameters as runtime arrays, the copy back into the module's storage, against the
reference ops; and the compile keys `selftest --device tpu` counts."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

jax = pytest.importorskip("jax")

from tpurec.embedding import ops  # noqa: E402
from tpurec.embedding.optimizers import adagrad, adam, sgd  # noqa: E402
from tpurec.embedding.optimizers.base import record_tpu_calls  # noqa: E402
from tpurec.embedding.tensorcore import tpu_bridge  # noqa: E402

from .compare import assert_close_f32, assert_close_table  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402

TRACES: list[str] = []


def _jax_op(name: str):
    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)
        assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values()), name
        static = tuple(i for i, p in enumerate(sig.parameters.values()) if p.annotation is not jax.Array)

        def traced(*args):
            TRACES.append(name)
            return fn(*args)

        jitted = jax.jit(traced, static_argnums=static)

        def call(*args):
            arrays = [jax.numpy.asarray(a.detach().cpu().numpy()) if isinstance(a, torch.Tensor) else a for a in args]
            out = jitted(*arrays)
            back = lambda a: torch.from_numpy(jax.numpy.asarray(a).__array__().copy())  # noqa: E731
            return tuple(back(o) for o in out) if isinstance(out, tuple) else back(out)

        return call

    return wrap


@pytest.fixture
def bridge(monkeypatch):
    pallas = types.ModuleType("torch_tpu._internal.pallas")
    pallas.jax_op = _jax_op
    for name in ("torch_tpu", "torch_tpu._internal"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.pallas", pallas)
    tpu_bridge._registered.cache_clear()
    TRACES.clear()
    yield tpu_bridge.kernels()
    tpu_bridge._registered.cache_clear()


def _args(name, csr, tensors, grad, t):
    if name == "sgd":
        return (*head(csr), *tensors, grad, 0.1, *tail(csr))
    if name in ("adagrad", "rowwise_adagrad"):
        return (*head(csr), *tensors, grad, 0.1, 1e-6, *tail(csr))
    return (*head(csr), *tensors, grad, adam.alpha_t(0.01 * t, 0.9, 0.999, t), 0.9, 0.999, 1e-6, *tail(csr))


OPS = {"sgd": sgd.op, "adagrad": adagrad.op, "rowwise_adagrad": adagrad.op, "adam": adam.op}


@pytest.mark.parametrize("name", list(OPS))
def test_three_steps_through_the_bridge_equal_the_reference(bridge, name):
    case = Case(num_sc=1, pooling="weighted")
    gen = torch.Generator().manual_seed(3)
    t0 = table(case, gen)
    rows, width = t0.shape
    states = {"sgd": [], "adagrad": [torch.rand(rows, width)], "rowwise_adagrad": [torch.rand(rows)]}
    state = states.get(name, [torch.zeros(rows, width), torch.zeros(rows, width)])
    want, got = [t0.clone(), *(s.clone() for s in state)], [t0.clone(), *(s.clone() for s in state)]
    storage = [g.data_ptr() for g in got]
    with record_tpu_calls() as calls:
        for t in (1, 2, 3):  # a learning rate (Adam: alpha_t) that changes every step
            csr = csr_input(case, gen)
            grad = torch.randn(case.device_batch_size, case.width, generator=gen)
            OPS[name](*_args(name, csr, want, grad, t))
            bridge[OPS[name]](*_args(name, csr, got, grad, t))
            assert_close_table(got[0], want[0])
            for g, w in zip(got[1:], want[1:]):
                assert_close_f32(g, w)
            out = bridge[ops.sparse_dense_matmul](*head(csr), got[0], *tail(csr))
            assert_close_f32(out, ops.sparse_dense_matmul(*head(csr), got[0], *tail(csr)))
    assert [g.data_ptr() for g in got] == storage  # updated in place: views of the storage stay live
    assert not torch.equal(got[0], t0)
    update = "adagrad" if name == "rowwise_adagrad" else name
    traces = [TRACES.count(f"tpurec_tensorcore::{n}") for n in (update, "lookup")]
    assert traces == [1, 1]  # hyper-parameters that change every step compile nothing new
    assert len({key for key in calls}) == 2  # one lookup and one update program, as selftest expects
