"""The compiled steps' dense update (tpurec/sharding/dense_update.py) against torch.optim's own step.

The oracle is torch.optim's SGD / Adagrad / Adam `step()` (their CPU single-tensor path, what the
eager trainer runs) on twin parameters, the lr changed every step as LRSchedule changes it. The
update here runs the same kernels on the same numbers: bit-equal, eagerly and under
torch.compile(fullgraph=True) with aot_eager, and the changing lr compiles no second graph.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tpurec.errors import UserError
from tpurec.sharding.dense_update import DenseOptimizer

STEPS = 20
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "eps": 1e-8}),
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
    return [torch.randn(p.shape, generator=gen) * (step + 1) for p in params]


def _lr(base: float, step: int) -> float:
    """LRSchedule's shape: 5 steps of warm-up, then a quadratic decay from step 10."""
    if step < 5:
        return base * (step + 1) / 5
    return base * max(0.0, 1.0 - (step - 10) / 12) ** 2 if step >= 10 else base


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dense_update_equals_torch_optim(kind, compiled):
    cls, kwargs = OPTIMIZERS[kind]
    ref_params, params = _params(0), _params(0)
    reference = cls(ref_params, **kwargs)
    mine = cls(params, **kwargs)
    update = DenseOptimizer(mine, params, None, 1)
    counter = CompileCounterWithBackend("aot_eager")
    apply = torch.compile(update.apply, fullgraph=True, dynamic=False, backend=counter) if compiled else update.apply
    for step in range(STEPS):
        for opt in (reference, mine):
            for g in opt.param_groups:
                g["lr"] = _lr(kwargs["lr"], step)
        for p, q, g in zip(ref_params, params, _grads(step, params)):
            p.grad, q.grad = g.clone(), g.clone()
        reference.step()
        apply(update.lr_inputs(), update.state_inputs())
        assert all(q.grad is None for q in params)
    for p, q, start in zip(ref_params, params, _params(0)):
        assert torch.equal(p, q), float((p - q).abs().max())
        assert not torch.equal(q, start)  # it trained
    for p, q in zip(ref_params, params):  # the state is the optimizer's own, the same as torch.optim's
        for key, value in reference.state[p].items():
            assert torch.equal(value, mine.state[q][key]), key
    if compiled:
        assert counter.frame_count == 1  # 20 lrs, one graph


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
    with pytest.raises(UserError, match="momentum=0.9"):
        DenseOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), params, None, 1)
    with pytest.raises(UserError, match="not foreach=True"):
        DenseOptimizer(torch.optim.Adagrad(params, lr=0.1, foreach=True), params, None, 1)
    with pytest.raises(UserError, match="not AdamW"):
        DenseOptimizer(torch.optim.AdamW(params, lr=0.1), params, None, 1)
    with pytest.raises(UserError, match="exactly the model's 2 dense parameters"):
        DenseOptimizer(torch.optim.SGD(params, lr=0.1), params[:2], None, 1)


def test_the_trainers_check_knows_the_same_dense_optimizers():
    from tpurec.dlrm.options import STEP_DENSE_OPTIMIZERS
    from tpurec.sharding.dense_update import SUPPORTED

    assert STEP_DENSE_OPTIMIZERS == SUPPORTED
