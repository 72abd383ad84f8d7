"""The TPU kernels of the TensorCore path (tensorcore/tpu_bridge.py), run on CPU through a stand-in
for TorchTPU's `jax_op` that does what the 0.2.0 bridge does (torch_tpu/_internal/pallas/pallas.py):
checks every argument is annotated, makes the non-array ones static, runs the function on the
tensors' buffers and hands back torch tensors. What this checks is the wiring: argument order,
the hyper-parameters as runtime arrays, the copy back into the module's storage (or the rows'
`index_copy_`), against the reference ops; and the compile keys `selftest --device tpu` counts."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

jax = pytest.importorskip("jax")

from tpurec.embedding import ops, step_scalars  # noqa: E402
from tpurec.embedding.optimizers import adagrad, adam, sgd  # noqa: E402
from tpurec.embedding.optimizers.adagrad import AdagradSpec  # noqa: E402
from tpurec.embedding.optimizers.adam import AdamSpec  # noqa: E402
from tpurec.embedding.optimizers.base import record_tpu_calls  # noqa: E402
from tpurec.embedding.optimizers.rowwise_adagrad import RowWiseAdagradSpec  # noqa: E402
from tpurec.embedding.optimizers.sgd import SGDSpec  # noqa: E402
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


def _two_copies(name: str, seed: int) -> tuple[Case, torch.Generator, torch.Tensor, list, list]:
    """A case, its generator, a table, and two copies of [table, optimizer `name`'s state]."""
    case = Case(num_sc=1, pooling="weighted")
    gen = torch.Generator().manual_seed(seed)
    t0 = table(case, gen)
    rows, width = t0.shape
    states = {"sgd": [], "adagrad": [torch.rand(rows, width)], "rowwise_adagrad": [torch.rand(rows)]}
    state = states.get(name, [torch.zeros(rows, width), torch.zeros(rows, width)])
    return case, gen, t0, [t0.clone(), *(s.clone() for s in state)], [t0.clone(), *(s.clone() for s in state)]


@pytest.mark.parametrize("route", ["copy", "rows"])
@pytest.mark.parametrize("name", list(OPS))
def test_three_steps_through_the_bridge_equal_the_reference(bridge, name, route, monkeypatch):
    """Either route (the new table copied back, or only its rows landed by `index_copy_`:
    TPUREC_TC_UPDATE=rows) updates the storage in place, equal to the reference."""
    monkeypatch.setenv(tpu_bridge.ROWS_ENV, route)
    case, gen, t0, want, got = _two_copies(name, 3)
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
    update = ("adagrad" if name == "rowwise_adagrad" else name) + ("_rows" if route == "rows" else "")
    traces = [TRACES.count(f"tpurec_tensorcore::{n}") for n in (update, "lookup")]
    assert traces == [1, 1]  # hyper-parameters that change every step compile nothing new
    assert len({key for key in calls}) == 2  # one lookup and one update program, as selftest expects


@pytest.mark.parametrize(
    ("route", "stream", "rows"),
    [(None, None, True), ("rows", None, True), ("copy", None, False), (None, "1", False), ("rows", "1", True)],
)
def test_the_rows_route_is_the_default_unless_copy_or_the_stream_is_asked_for(monkeypatch, route, stream, rows):
    """Rows landed by `index_copy_` unless TPUREC_TC_UPDATE=copy, or TPUREC_PALLAS_STREAM=1 (which
    writes whole tables) with no route named; a route named wins over the stream."""
    for name, value in ((tpu_bridge.ROWS_ENV, route), ("TPUREC_PALLAS_STREAM", stream)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert tpu_bridge.rows_route() is rows


def test_an_unknown_update_route_is_a_user_error_naming_the_variable(monkeypatch):
    from tpurec.errors import UserError

    monkeypatch.setenv(tpu_bridge.ROWS_ENV, "inplace")
    with pytest.raises(UserError, match="TPUREC_TC_UPDATE='inplace': expected 'rows'"):
        tpu_bridge.rows_route()


class _RecordingFeed(step_scalars.Feed):
    def take(self, name, value):
        TAKEN.append(name)
        return super().take(name, value)


TAKEN: list[str] = []


def _spec(name: str, t: int):
    """The spec whose `device_scalars` are what `_args` hands the kernel at step t."""
    if name == "sgd":
        return SGDSpec(lr=0.1)
    if name == "adagrad":
        return AdagradSpec(lr=0.1, eps=1e-6)
    if name == "rowwise_adagrad":
        return RowWiseAdagradSpec(lr=0.1, eps=1e-6)
    return AdamSpec(lr=0.01 * t, eps=1e-6, beta1=0.9, beta2=0.999)


@pytest.mark.parametrize("name", list(OPS))
def test_a_compiled_steps_update_takes_every_scalar_from_its_feed(bridge, name):
    # Inside a compiled step's update the kernels' device scalars are the step feed's entries
    # (tpurec/embedding/step_scalars.py: on a TPU a tensor made there from a host value is no input of
    # the program). The feed a spec's `device_scalars` fills holds every scalar the TensorCore kernel
    # asks for, with the value it computed: the same numbers, bit for bit, as without a feed.
    case, gen, t0, plain, fed = _two_copies(name, 5)
    width = t0.shape[1]
    for t in (1, 2, 3):
        csr = csr_input(case, gen)
        grad = torch.randn(case.device_batch_size, case.width, generator=gen)
        bridge[OPS[name]](*_args(name, csr, plain, grad, t))
        spec = _spec(name, t)
        values = spec.device_scalars(spec.lr, t, width, width)
        TAKEN.clear()
        with step_scalars.feeding(_RecordingFeed(step_scalars.host_row(values), values)):
            bridge[OPS[name]](*_args(name, csr, fed, grad, t))
        want = {"sgd": ["lr"], "adam": list(adam.DEVICE_SCALARS)}.get(name, ["lr", "eps"])
        assert TAKEN == want
        for p, f in zip(plain, fed):
            assert torch.equal(p, f)
    assert not torch.equal(fed[0], t0)


def test_a_feed_refuses_a_value_it_does_not_hold(bridge):
    case = Case(num_sc=1, pooling="weighted")
    gen = torch.Generator().manual_seed(5)
    t0 = table(case, gen)
    csr = csr_input(case, gen)
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    values = SGDSpec(lr=0.2).device_scalars(0.2, 1, t0.shape[1], t0.shape[1])  # the kernel is given 0.1
    with step_scalars.feeding(step_scalars.Feed(step_scalars.host_row(values), values)):
        with pytest.raises(AssertionError, match=r"computed lr=0.1, its feed holds 0.2"):
            bridge[sgd.op](*_args("sgd", csr, [t0], grad, 1))
    adagrad_values = {"lr": 0.1}  # no eps
    with step_scalars.feeding(step_scalars.Feed(step_scalars.host_row(adagrad_values), adagrad_values)):
        with pytest.raises(AssertionError, match=r"asked for 'eps'; its feed holds \['lr'\]"):
            bridge[adagrad.op](*_args("adagrad", csr, [t0, torch.rand_like(t0)], grad, 1))
