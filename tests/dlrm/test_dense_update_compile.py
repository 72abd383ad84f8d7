"""The eager step's dense update compiled (tpurec/dlrm/training/dense_update_compile.py, part of
`--compile-dense` and of a real TPU's default): the torch optimizer's step replaced by the compiled
`DenseOptimizer.apply`, the same parameters and state as torch.optim's own step, bit for bit, a
changing lr compiling nothing new; what it does not implement keeps torch.optim's step."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from tpurec.dlrm.training.dense_update_compile import FOREACH_SWITCH, compile_dense_update

OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-8),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own updates: the closures share one code object, whose compilations
    Dynamo caps per process (recompile_limit 8); a run of `tpurec train` compiles one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _keyed(model: torch.nn.Module, make) -> CombinedOptimizer:
    """The trainer's shape of optimizer (model.build_optimizer): a CombinedOptimizer over a wrapper."""
    return CombinedOptimizer([KeyedOptimizerWrapper(dict(model.named_parameters()), make)])


class _Counting:
    """A Dynamo backend that counts the graphs it is handed (aot_eager's numbers)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, inputs)


def _train(model, opt, steps: int = 4) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:  # a schedule: a new lr every step
            g["lr"] = 0.05 / (step + 1)
        x = torch.randn(32, 6, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("foreach", ["0", "1"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_compiled_update_steps_as_torch_optim_bit_for_bit_and_compiles_once(name, foreach, monkeypatch):
    monkeypatch.setenv(FOREACH_SWITCH, foreach)
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager_opt = _keyed(eager_model, OPTIMIZERS[name])
    compiled_opt = _keyed(compiled_model, OPTIMIZERS[name])
    backend = _Counting()
    said = compile_dense_update(compiled_opt, compiled_model, "cpu", backend=backend)
    assert said.startswith(f"the dense update ({name.split('_')[0]}, 4 tensors) compiled")
    assert _train(compiled_model, compiled_opt) == _train(eager_model, eager_opt)
    for got, want in zip(compiled_model.parameters(), eager_model.parameters()):
        assert torch.equal(got, want)
    got_state, want_state = compiled_opt.state_dict()["state"], eager_opt.state_dict()["state"]
    assert got_state.keys() == want_state.keys()
    for key in want_state:
        for k, v in want_state[key].items():
            assert torch.equal(torch.as_tensor(got_state[key][k]).cpu(), torch.as_tensor(v)), (key, k)
    assert backend.graphs == 1  # four steps, four lrs: one graph
    assert all(p.grad is None for p in compiled_model.parameters())  # cleared, as the graph does


class _Mutations(_Counting):
    """`_Counting` that records how many of each graph's inputs AOTAutograd found mutated: with
    `keep_inference_input_mutations=False` (TorchTPU's backend, and `_Counting`'s aot_autograd) each
    is copied back by an eager `copy_` after the graph, an op of its own on TorchTPU."""

    def __init__(self) -> None:
        super().__init__()
        self.mutated: list[int] = []

    def __call__(self, gm, inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._guards import TracingContext

        def forward(g, _):
            context = TracingContext.try_get()
            assert context is not None and context.fw_metadata is not None
            self.mutated.append(context.fw_metadata.num_mutated_inp_runtime_indices)
            return g.forward

        self.graphs += 1
        return aot_autograd(fw_compiler=forward)(gm, inputs)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_with_foreach_copy_the_graph_mutates_no_input_and_the_live_tensors_take_the_results(name, monkeypatch):
    """TPUREC_DENSE_FOREACH_COPY=1: the compiled update returns its results and one `_foreach_copy_`
    per device puts them back, into the same tensors (an alias taken before the step sees the new
    values), instead of an eager copy per parameter and state tensor after the graph (the default:
    the graph mutates them, `mutated` 12 for Adagrad's 4 parameters, steps and sums)."""
    monkeypatch.setenv(FOREACH_SWITCH, "1")
    model = _model()
    opt = _keyed(model, OPTIMIZERS[name])
    backend = _Mutations()
    compile_dense_update(opt, model, "cpu", backend=backend)
    _train(model, opt, steps=2)  # compiled, and every state made
    alias = model[0].weight.detach()
    before = alias.clone()
    state = opt.state_dict()["state"]
    key = next(iter(state))
    tensors = {k: v for k, v in state[key].items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    kept = {k: v.clone() for k, v in tensors.items()}
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert backend.graphs == 1 and backend.mutated == [0]
    assert not torch.equal(alias, before) and alias.data_ptr() == model[0].weight.data_ptr()
    assert tensors and all(not torch.equal(v, kept[k]) for k, v in tensors.items())
    monkeypatch.setenv(FOREACH_SWITCH, "0")
    in_place = _Mutations()
    compile_dense_update(opt, model, "cpu", backend=in_place)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert in_place.mutated and in_place.mutated[0] >= 8  # the 4 parameters and their state


def test_an_optimizer_it_does_not_implement_keeps_torch_optims_step():
    model = _model()
    opt = _keyed(model, lambda ps: torch.optim.RMSprop(ps, lr=0.01))
    inner = opt.optimizers[0][1]._optimizer
    said = compile_dense_update(opt, model, "cpu")
    assert said.startswith("the dense update stays eager (") and "RMSprop" in said
    assert "step" not in vars(inner)  # no instance attribute: the class's own step
    reference = _model()
    assert _train(model, opt) == _train(reference, _keyed(reference, lambda ps: torch.optim.RMSprop(ps, lr=0.01)))


class _Symbols(_Counting):
    """`_Counting` that also records the graph inputs Dynamo made symbols of (a view's storage offset
    is one even under dynamic=False: TorchTPU's backend fails on it, session 37's chip run)."""

    def __init__(self) -> None:
        super().__init__()
        self.symbols: list[str] = []

    def __call__(self, gm, inputs):
        self.symbols += [n.name for n in gm.graph.nodes if n.op == "placeholder" and "SymInt" in str(n.type)]
        return super().__call__(gm, inputs)


def test_ddp_bucket_view_gradients_reach_the_graph_as_static_slices_of_their_buckets(tmp_path):
    """Under DDP with `gradient_as_bucket_view` (TorchRec DMP's wrapper) each gradient is a view of a
    flat bucket: the compiled update takes the buckets and cuts the gradients at constant offsets, no
    symbol among its inputs, the numbers torch.optim's, one more graph when DDP rebuilds its buckets."""
    import torch.distributed as dist

    # one rank's default group; one left by another test of this process serves as well
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        _check_ddp_bucket_views()
    finally:
        if ours:
            dist.destroy_process_group()


def _check_ddp_bucket_views() -> None:
    import torch.distributed as dist

    group = dist.new_group([0], backend="gloo")
    eager_model, compiled_model = _model(), _model()
    ddp = torch.nn.parallel.DistributedDataParallel(compiled_model, process_group=group, gradient_as_bucket_view=True)
    eager_opt = _keyed(eager_model, OPTIMIZERS["adagrad"])
    compiled_opt = _keyed(compiled_model, OPTIMIZERS["adagrad"])
    backend = _Symbols()
    compile_dense_update(compiled_opt, compiled_model, "cpu", backend=backend)
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
    ddp(x).sum().backward()
    grad = next(compiled_model.parameters()).grad
    assert grad is not None and grad._base is not None  # the case: a bucket's view
    compiled_opt.step()
    eager_model(x).sum().backward()
    eager_opt.step()
    assert _train(ddp, compiled_opt) == _train(eager_model, eager_opt)
    for got, want in zip(compiled_model.parameters(), eager_model.parameters()):
        assert torch.equal(got, want)
    assert backend.symbols == [] and 1 <= backend.graphs <= 2, (backend.symbols, backend.graphs)
