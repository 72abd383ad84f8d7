"""The compiled steps' dense update (tpurec/sharding/step/dense_update.py, dense_supported.py and
dense_arithmetic.py) against torch.optim's own step.

The oracle is torch.optim's SGD / Adagrad / Adam / AdamW `step()` (their CPU single-tensor path,
what the eager trainer runs), with the options users' dense optimizers carry (weight decay,
momentum, dampening, nesterov, lr_decay, amsgrad), on twin parameters, the lr changed every step
as LRSchedule changes it. The update here runs the same kernels on the same numbers: bit-equal
(signed zeros too), eagerly and under torch.compile(fullgraph=True) with aot_eager, and the changing
lr compiles no second graph; through a state_dict round trip; and inside CompiledStep /
PipelinedStep under DMP against TorchRec's eager step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tpurec.errors import UserError
from tpurec.sharding.step.dense_update import DenseOptimizer

STEPS = 20
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "eps": 1e-8}),
    # the options users' dense optimizers carry
    "sgd-weight-decay": (torch.optim.SGD, {"lr": 0.05, "weight_decay": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd-dampening": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-3}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-3}),
    "adagrad-decay": (torch.optim.Adagrad, {"lr": 0.05, "weight_decay": 0.01, "lr_decay": 0.05}),
    "adam-l2": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.99)}),
    "adamw-amsgrad": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # a vector length that is no multiple of any SIMD width: the kernels' scalar tails run too
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(37, 19), (19,), (1013,)]]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen) * (step + 1) for p in params]
    if step == 0:  # signed zeros: a first momentum buffer must be the gradient's clone, -0.0 kept
        for g in grads:
            g.view(-1)[::7] = -0.0
            g.view(-1)[3::11] = 0.0
    return grads


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _lr(base: float, step: int) -> float:
    """LRSchedule's shape: 5 steps of warm-up, then a quadratic decay from step 10."""
    if step < 5:
        return base * (step + 1) / 5
    return base * max(0.0, 1.0 - (step - 10) / 12) ** 2 if step >= 10 else base


def _assert_same(reference, ref_params, mine, params) -> None:
    """Parameters and the optimizers' own state bit for bit, the state keys alike."""
    for p, q in zip(ref_params, params):
        assert _bits_equal(p.detach(), q.detach()), float((p - q).abs().max())
        assert reference.state[p].keys() == mine.state[q].keys()
        for key, value in reference.state[p].items():
            assert _bits_equal(value, mine.state[q][key]), key


def _step(step: int, base_lr: float, pairs, without: tuple[int, ...] = ()) -> None:
    """One step of each (optimizer, params, run): the lr of `step`, the same gradients (none for the
    parameters `without`), `run()`."""
    grads = _grads(step, pairs[0][1])
    for opt, params, run in pairs:
        for g in opt.param_groups:
            g["lr"] = _lr(base_lr, step)
        if isinstance(run, _Update):
            run.take_inputs()  # before the gradients, as the compiled steps do before their backward
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in without else g.clone()
        run()


class _Update:
    """`DenseOptimizer.apply` as CompiledStep / PipelinedStep run it: its inputs taken before the
    backward, compiled (fullgraph, aot_eager, counted by `counter`) or not (counter None)."""

    def __init__(self, update: DenseOptimizer, counter=None) -> None:
        self.update = update
        self.apply = update.apply
        if counter is not None:
            self.apply = torch.compile(update.apply, fullgraph=True, dynamic=False, backend=counter)

    def take_inputs(self) -> None:
        self.inputs = (self.update.lr_inputs(), self.update.state_inputs())

    def __call__(self) -> None:
        self.apply(*self.inputs)


def _compiled(update: DenseOptimizer, counter) -> _Update:
    return _Update(update, counter)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dense_update_equals_torch_optim(kind, compiled):
    cls, kwargs = OPTIMIZERS[kind]
    ref_params, params = _params(0), _params(0)
    reference = cls(ref_params, **kwargs)
    mine = cls(params, **kwargs)
    update = DenseOptimizer(mine, params, None, 1)
    counter = CompileCounterWithBackend("aot_eager")
    run = _Update(update, counter if compiled else None)
    for step in range(STEPS):
        _step(step, kwargs["lr"], [(reference, ref_params, reference.step), (mine, params, run)])
        assert all(q.grad is None for q in params)
        _assert_same(reference, ref_params, mine, params)  # every step: the first one's signed zeros too
    assert not any(torch.equal(q, start) for q, start in zip(params, _params(0)))  # it trained
    if compiled:
        assert counter.frame_count == 1  # 20 lrs, one graph


@pytest.mark.parametrize("kind", ["sgd-dampening", "sgd-nesterov", "adagrad-decay", "adamw-amsgrad", "adam-l2"])
def test_dense_update_state_dict_round_trip(kind):
    """Compiled steps, a checkpoint of the optimizer, loaded into a fresh one: continued by
    torch.optim's eager step, and by a new compiled update over it, both equal the compiled update
    that never stopped (the state the graph leaves is torch.optim's, its momentum buffers too)."""

    cls, kwargs = OPTIMIZERS[kind]
    params = _params(0)
    mine = cls(params, **kwargs)
    counter = CompileCounterWithBackend("aot_eager")
    run = _compiled(DenseOptimizer(mine, params, None, 1), counter)
    for step in range(3):
        _step(step, kwargs["lr"], [(mine, params, run)])
    saved = copy.deepcopy(mine.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed_opt, eager_opt = cls(resumed, **kwargs), cls(eager, **kwargs)
    resumed_opt.load_state_dict(copy.deepcopy(saved))
    eager_opt.load_state_dict(copy.deepcopy(saved))
    resumed_run = _compiled(DenseOptimizer(resumed_opt, resumed, None, 1), counter)
    for step in range(3, 8):
        _step(
            step,
            kwargs["lr"],
            [(mine, params, run), (eager_opt, eager, eager_opt.step), (resumed_opt, resumed, resumed_run)],
        )
        _assert_same(eager_opt, eager, mine, params)
        _assert_same(eager_opt, eager, resumed_opt, resumed)


@pytest.mark.parametrize("first_by", ["graph", "torch_optim"])
def test_dense_update_steps_a_late_momentum_buffer_as_torch_optim(first_by):
    """A parameter whose first gradient comes late: its buffer (zeros, made up front: the graph
    cannot add state) is none of torch.optim's until then: its state_dict leaves it out (a resume
    from it equals the run), and its first step, by the graph or by torch.optim's own `step()`, is
    the gradient's clone (dampening 0.5 would scale anything else)."""
    kwargs = {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}
    ref_params, params = _params(0), _params(0)
    reference, mine = torch.optim.SGD(ref_params, **kwargs), torch.optim.SGD(params, **kwargs)
    run = _compiled(DenseOptimizer(mine, params, None, 1), CompileCounterWithBackend("aot_eager"))
    for step in range(2):  # the last parameter has no gradient yet
        _step(step, kwargs["lr"], [(reference, ref_params, reference.step), (mine, params, run)], (2,))
        assert not mine.state[params[2]]["momentum_buffer"].any()  # made, not stepped
        _assert_same(reference, ref_params[:2], mine, params[:2])
        assert torch.equal(ref_params[2], params[2])
    saved = copy.deepcopy(mine.state_dict())
    assert saved["state"].keys() == reference.state_dict()["state"].keys() == {0, 1}
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed_opt = torch.optim.SGD(resumed, **kwargs)
    resumed_opt.load_state_dict(saved)
    for step in range(2, 5):
        mine_run = mine.step if first_by == "torch_optim" and step == 2 else run
        pairs = [(reference, ref_params, reference.step), (mine, params, mine_run)]
        _step(step, kwargs["lr"], [*pairs, (resumed_opt, resumed, resumed_opt.step)])
        _assert_same(reference, ref_params, mine, params)
        _assert_same(reference, ref_params, resumed_opt, resumed)


def test_dense_update_finds_the_dense_optimizer_in_the_trainers_combined_optimizer():
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    params = _params(0)
    other = KeyedOptimizerWrapper({"x": torch.nn.Parameter(torch.zeros(3))}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    named = {f"p{i}": p for i, p in enumerate(params)}
    dense = KeyedOptimizerWrapper(named, lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    update = DenseOptimizer(CombinedOptimizer([other, dense]), params, None, 1)
    assert update.optimizer is dense._optimizer and update.kind == "adagrad"
    assert DenseOptimizer(0.5, params, None, 1).optimizer.param_groups[0]["lr"] == 0.5  # a float: plain SGD


def test_dense_update_refuses_what_it_does_not_implement():
    params = _params(0)
    with pytest.raises(UserError, match="^the compiled/pipelined step's dense SGD does not implement maximize=True"):
        DenseOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, maximize=True), params, None, 1)
    with pytest.raises(UserError, match="dense AdamW does not implement capturable=True"):
        DenseOptimizer(torch.optim.AdamW(params, lr=0.1, capturable=True), params, None, 1)
    with pytest.raises(UserError, match="not foreach=True"):
        DenseOptimizer(torch.optim.Adagrad(params, lr=0.1, foreach=True), params, None, 1)
    with pytest.raises(UserError, match="not fused=True"):
        DenseOptimizer(torch.optim.Adam(params, lr=0.1, fused=True), params, None, 1)
    with pytest.raises(UserError, match="dense Adam takes betas as a float, not a tensor"):
        DenseOptimizer(torch.optim.Adam(params, lr=0.1, betas=(torch.tensor(0.9), torch.tensor(0.99))), params, None, 1)
    with pytest.raises(UserError, match="implements torch.optim SGD, Adagrad, Adam, AdamW, not RAdam"):
        DenseOptimizer(torch.optim.RAdam(params, lr=0.1), params, None, 1)
    with pytest.raises(UserError, match="exactly the model's 2 dense parameters"):
        DenseOptimizer(torch.optim.SGD(params, lr=0.1), params[:2], None, 1)


def test_the_trainers_check_knows_the_same_dense_optimizers():
    from tpurec.dlrm.options import STEP_DENSE_OPTIMIZERS
    from tpurec.sharding.step.dense_supported import SUPPORTED

    assert STEP_DENSE_OPTIMIZERS == SUPPORTED


def test_dense_update_follows_a_momentum_buffer_loaded_over_a_fresh_one():
    """A buffer the update made (fresh, not yet stepped) and then replaced by `load_state_dict` of a
    checkpoint is a stepped one: the next step applies the momentum to it, as torch.optim does."""
    kwargs = {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}
    ref_params, params = _params(0), _params(0)
    reference, mine = torch.optim.SGD(ref_params, **kwargs), torch.optim.SGD(params, **kwargs)
    _step(0, kwargs["lr"], [(reference, ref_params, reference.step)])
    update = DenseOptimizer(mine, params, None, 1)
    for p in params:
        p.grad = torch.ones_like(p)
    update.state_inputs()  # makes the buffers, fresh
    with torch.no_grad():
        for p, q in zip(params, ref_params):
            p.copy_(q)
    mine.load_state_dict(copy.deepcopy(reference.state_dict()))  # torch.optim shares tensors otherwise
    run = _compiled(update, CompileCounterWithBackend("aot_eager"))
    _step(1, kwargs["lr"], [(reference, ref_params, reference.step), (mine, params, run)])
    _assert_same(reference, ref_params, mine, params)


def _dmp_optimizer(dmp, kind: str):
    """The trainer's shape of optimizer: the DMP's fused table optimizer beside the dense `kind`."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    cls, kwargs = OPTIMIZERS[kind]
    named = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(named, lambda ps: cls(ps, **kwargs))])


def _assert_same_dmp(eager, eager_opt, twin, twin_opt) -> None:
    """Every parameter (tables too) and the dense optimizer's state, bit for bit."""
    eager_state, twin_state = eager_opt.state_dict()["state"], twin_opt.state_dict()["state"]
    assert eager_state.keys() == twin_state.keys()
    dense = [key for key in eager_state if "embedding_bags" not in key]
    assert len(dense) == 8  # the dense MLPs' weights and biases
    for key in dense:
        assert eager_state[key].keys() == twin_state[key].keys()
        for name, tensor in eager_state[key].items():
            assert _bits_equal(tensor, twin_state[key][name]), (key, name)
    for (name, p), (_, q) in zip(eager.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["sgd-dampening", "sgd-nesterov", "adamw-amsgrad"])
def test_compiled_dmp_step_with_the_options_equals_the_eager_step(kind):
    """The options in `CompiledStep` (its dense inputs taken before the backward, the momentum
    buffers made then): 8 steps of a DLRM under tpurec's DMP bit-equal to TorchRec's eager step with
    torch.optim's, one graph under a changing lr, the dense state the same."""
    from tests.helpers.dlrm_step import BATCH, dlrm_dmp
    from tpurec.sharding.step.compiled import CompiledStep

    from .dlrm_case import batches, eager_step

    lr = OPTIMIZERS[kind][1]["lr"]
    eager, twin = dlrm_dmp(1, None), dlrm_dmp(1, None)
    eager_opt, twin_opt = _dmp_optimizer(eager, kind), _dmp_optimizer(twin, kind)
    counter = CompileCounterWithBackend("aot_eager")
    step = CompiledStep(twin, twin_opt, backend=counter)
    for i, batch in enumerate(batches(8, BATCH, 0, 1)):
        for opt in (eager_opt, twin_opt):
            for g in opt.optimizers[1][1].param_groups:
                g["lr"] = _lr(lr, i)
        assert float(step.step(batch)) == eager_step(eager, eager_opt, batch), i
    assert counter.frame_count == 1
    _assert_same_dmp(eager, eager_opt, twin, twin_opt)


@pytest.mark.parametrize("kind", ["sgd-dampening", "adamw-amsgrad"])
def test_pipelined_step_with_the_options_equals_the_eager_step(kind):
    """The same in the compiled `PipelinedStep` on batches touching disjoint rows (where it is
    exact): 10 batches, the losses, parameters and dense state as TorchRec's eager step's."""
    from tests.helpers.dlrm_step import BATCH, disjoint_batches, dlrm_dmp
    from tpurec.sharding.step.pipelined import PipelinedStep

    from .dlrm_case import eager_step

    eager, twin = dlrm_dmp(1, None), dlrm_dmp(1, None)
    eager_opt, twin_opt = _dmp_optimizer(eager, kind), _dmp_optimizer(twin, kind)
    data = disjoint_batches(10, BATCH, 0, 1)
    eager_losses = [eager_step(eager, eager_opt, batch) for batch in data]
    counter = CompileCounterWithBackend("aot_eager")
    pipe = PipelinedStep(twin, twin_opt, backend=counter)
    losses = [float(loss) for loss in map(pipe.step, data) if loss is not None]
    losses += [float(x) for x in pipe.drain()]
    assert counter.frame_count == 1
    assert losses == eager_losses
    _assert_same_dmp(eager, eager_opt, twin, twin_opt)


def test_the_dense_gradients_are_averaged_over_the_ranks(monkeypatch):
    """`_mean_over_ranks` on rank 0 of 2, the functional all-reduce faked with rank 1's contribution:
    each gradient is the mean of the two ranks', in its own shape."""
    import torch.distributed._functional_collectives as funcol

    from tpurec.sharding.step.dense_update import _mean_over_ranks

    other = torch.tensor([0.0, 8.0, -2.0, 6.0])  # rank 1's gradients, concatenated

    def all_reduce(flat, op, group):
        assert op == "sum" and group == "g"
        return flat + other / 2  # rank 1 divides by the world size too

    monkeypatch.setattr(funcol, "all_reduce", all_reduce)
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([[6.0], [10.0]])]
    out = _mean_over_ranks(grads, "g", 2)
    assert [g.tolist() for g in out] == [[1.0, 6.0], [[2.0], [8.0]]]
    assert _mean_over_ranks(grads, "g", 1) is grads and _mean_over_ranks([], "g", 2) == []


@pytest.mark.parametrize("kind", ["sgd-momentum", "adagrad-decay", "adamw-amsgrad"])
def test_dense_update_with_device_scalars_traces_no_float64_and_stays_near_torch_optim(kind):
    """`scalars_on` (what a TorchTPU device gets, `scalar_device`): the lrs, flags and step counts are
    float32 there and the traced update holds no float64 value (the TPU has none), so its numbers are
    torch.optim's within float32 rounding of the scalars; one graph for 20 lrs."""
    from tpurec.sharding.step.dense_update import scalar_device

    cls, kwargs = OPTIMIZERS[kind]
    ref_params, params = _params(0), _params(0)
    reference, mine = cls(ref_params, **kwargs), cls(params, **kwargs)
    update = DenseOptimizer(mine, params, None, 1, scalars_on=torch.device("cpu"))
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm

    run = _Update(update, recording)
    for step in range(STEPS):
        _step(step, kwargs["lr"], [(reference, ref_params, reference.step), (mine, params, run)])
        inputs = [t for t in run.inputs[0]] + [t for g in run.inputs[1] for ts in g for t in ts]
        assert all(t.dtype != torch.float64 for t in inputs)
    assert len(graphs) == 1
    values = [n.meta.get("example_value") for n in graphs[0].graph.nodes]
    dtypes = {v.dtype for v in values if isinstance(v, torch.Tensor)}
    assert torch.float32 in dtypes and torch.float64 not in dtypes, dtypes
    worst = max(float(((p - q).abs() / (p.abs() + 1e-3)).max().detach()) for p, q in zip(ref_params, params))
    # within float32 rounding of the scalars over 20 steps (Adam's 1 - beta2**step is the worst:
    # 1e-3 in float32 holds ~6e-5 of relative error; SGD's lr is a float32 in both: bit-equal)
    assert worst < 1e-3, worst
    assert not any(torch.equal(q, start) for q, start in zip(params, _params(0)))
    assert scalar_device(params) is None  # CPU parameters: the host's float64 arithmetic


def test_dense_update_moves_a_host_step_count_to_the_scalar_device():
    """A step count torch.optim's init (or a resume) left elsewhere is moved into the optimizer's
    state on `scalars_on` by `state_inputs` (a TorchTPU program refuses a host tensor argument)."""
    params = _params(1)
    opt = torch.optim.Adagrad(params, lr=0.1)
    update = DenseOptimizer(opt, params, None, 1, scalars_on=torch.device("meta"))
    (group,) = update.state_inputs()
    assert all(step.device.type == "meta" and opt.state[p]["step"] is step for (step, _), p in zip(group, params))
    assert all(s.device.type == "cpu" for (_, s) in group)  # the sums stay with their parameters
    assert all(t.device.type == "meta" and t.dtype == torch.float32 for t in update.lr_inputs())
