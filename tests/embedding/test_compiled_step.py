"""A training step of a model on tpurec's kernel compiled with torch.compile(fullgraph=True): one graph,
no graph break, and the eager step's numbers (tpurec/embedding/custom_ops.py, docs/kernels.md
"Compiled step").

The oracle is the eager step of an identical copy of the model (the default path, through
`_FusedLookup`), on the same batches; the compiled step preprocesses each batch eagerly, then runs
lookup, dense model, loss, backward (the fused update) and the dense optimizer in one graph.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tpurec.embedding import ops
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.emulation import torchtpu_ops as tpu_standin

from .helpers import fused_optimizers, make_tables, random_kjt

BATCH, DENSE, STEPS = 8, 3, 5
DENSE_LR = 0.05


@pytest.fixture(autouse=True)
def _trace_backward():
    # loss.backward() inside the compiled step: Dynamo traces it only with this set (TorchRec's
    # SparseCoreTrainPipeline sets it too); a fresh cache per test, so every test compiles its own graph.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield
    torch._dynamo.reset()


class TinyModel(torch.nn.Module):
    """Pooled embeddings and dense features -> one logit (a DLRM without interaction)."""

    def __init__(self, tables: list[EmbeddingBagConfig], optimizer: type, kwargs: dict) -> None:
        super().__init__()
        # Fixed id limits: every batch's SparseCore inputs have the same shapes (one graph, as on a TPU).
        self.ebc = SparseCoreEmbeddingBagCollection(
            tables, optimizer, kwargs, num_sparsecores=2, device="cpu", max_ids_per_partition=64
        )
        kernel = self.ebc.kernel
        self.initial_tables = {name: kernel.read_weight(name).clone() for name in kernel.table_names}
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
        self.dense = torch.nn.Linear(width + DENSE, 1)

    def head(self, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.dense(torch.cat([pooled, dense], dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _optimizers() -> dict:
    """The kernel tests' four fused optimizers, and row-wise Adagrad and Adam with weight decay."""
    out = fused_optimizers()
    cls, kwargs = out["rowwise_adagrad"]
    for mode in ("L2", "DECOUPLE"):
        out[f"rowwise_adagrad_{mode}"] = (cls, {**kwargs, "weight_decay": 0.05, "weight_decay_mode": mode})
    cls, kwargs = out["adam"]
    out["adam_decay"] = (cls, {**kwargs, "weight_decay": 0.05})
    return out


def _batches(tables: list[EmbeddingBagConfig]) -> list[tuple]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        kjt = random_kjt(tables, BATCH, gen, weighted=False)
        out.append(
            (kjt, torch.randn(BATCH, DENSE, generator=gen), torch.randint(0, 2, (BATCH,), generator=gen).float())
        )
    return out


def _train_pair(
    optimizer_name: str, backend: str, dense_in_graph: bool = True
) -> tuple[TinyModel, TinyModel, list, list, CompileCounterWithBackend]:
    torch.manual_seed(0)
    tables = make_tables()
    model = TinyModel(tables, *_optimizers()[optimizer_name])
    twin = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(model.dense.parameters(), lr=DENSE_LR)

    def compiled_part(csrs: list, dense: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = twin.head(twin.ebc.kernel.lookup(csrs, BATCH), dense, labels)
        loss.backward()
        # torch.optim's step() breaks the graph on purpose (optimizer.py, `_use_grad`); its SGD on CPU
        # is this loop (w += -lr * g), so the dense update stays in the graph, as TorchRec's pipeline
        # keeps its functional dense optimizer in its compiled step
        if dense_in_graph:
            _dense_sgd(twin)
        return loss.detach()

    counter = CompileCounterWithBackend(backend)
    step = torch.compile(compiled_part, fullgraph=True, dynamic=False, backend=counter)
    eager_losses, compiled_losses = [], []
    for n, (kjt, dense, labels) in enumerate(_batches(tables)):
        if n == 2:  # a scheduler's move: a runtime value in the program, so no recompile
            for m in (model, twin):
                for group in m.ebc.fused_optimizer.param_groups:
                    cast(dict, group)["lr"] *= 0.5  # torchrec types the groups as Mappings
                # as in stock TorchRec, a new lr reaches the kernel at zero_grad() or step()
                m.ebc.fused_optimizer.zero_grad()
        loss = model.head(model.ebc(kjt).values(), dense, labels)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_losses.append(float(loss.detach()))
        csrs = twin.ebc.kernel.preprocess(kjt)  # host side, outside the compiled step
        twin.ebc.kernel.begin_compiled_step()  # the step's count and update scalars (step_scalars.py)
        compiled_losses.append(float(step(csrs, dense, labels)))
        if not dense_in_graph:
            _dense_sgd(twin)
    return model, twin, eager_losses, compiled_losses, counter


def _first_batch(optimizer_name: str) -> tuple[TinyModel, list, torch.Tensor, torch.Tensor]:
    """A fresh model and its first batch, preprocessed."""
    torch.manual_seed(0)
    tables = make_tables()
    model = TinyModel(tables, *fused_optimizers()[optimizer_name])
    kjt, dense, labels = _batches(tables)[0]
    return model, model.ebc.kernel.preprocess(kjt), dense, labels


def _device_half(model: TinyModel) -> Any:
    """The step's device half on preprocessed inputs: lookup, head, loss, backward (the fused updates)."""

    def part(csrs: list, dense: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = model.head(model.ebc.kernel.lookup(csrs, BATCH), dense, labels)
        loss.backward()
        return loss.detach()

    return part


def _dense_sgd(model: TinyModel) -> None:
    with torch.no_grad():
        for p in model.dense.parameters():
            assert p.grad is not None
            p.add_(p.grad, alpha=-DENSE_LR)
            p.grad = None


def _assert_same_training(model: TinyModel, twin: TinyModel, eager: list, compiled: list, tol: float) -> None:
    assert compiled == pytest.approx(eager, abs=tol, rel=0)
    kernel, twin_kernel = model.ebc.kernel, twin.ebc.kernel
    for name in kernel.table_names:
        torch.testing.assert_close(twin_kernel.read_weight(name), kernel.read_weight(name), atol=tol, rtol=0)
        for state in kernel.optimizer.state_names:
            torch.testing.assert_close(
                twin_kernel.read_state(name, state), kernel.read_state(name, state), atol=tol, rtol=0
            )
        assert twin_kernel.step_count(name) == kernel.step_count(name) == STEPS
    # the updates ran: every table moved from its initial values (an update that never ran would
    # leave both copies equal to them)
    for name, before in model.initial_tables.items():
        assert float((kernel.read_weight(name) - before).abs().max()) > 1e-3, name
    for p, q in zip(model.dense.parameters(), twin.dense.parameters()):
        torch.testing.assert_close(q, p, atol=tol, rtol=0)


@pytest.mark.parametrize(
    "optimizer_name",
    ["sgd", "adagrad", "rowwise_adagrad", "adam", "rowwise_adagrad_L2", "rowwise_adagrad_DECOUPLE", "adam_decay"],
)
def test_compiled_step_equals_eager_aot_eager(optimizer_name):
    model, twin, eager, compiled, counter = _train_pair(optimizer_name, "aot_eager")
    assert counter.frame_count == 1  # one graph for all 5 batches: no graph break, no recompile
    _assert_same_training(model, twin, eager, compiled, tol=0.0)  # the same kernels in the same order: bit-equal


def test_compiled_step_graph_holds_the_ops_and_no_break():
    model, csrs, dense, labels = _first_batch("adagrad")
    model.ebc.kernel.begin_compiled_step()
    explained = torch._dynamo.explain(_device_half(model))(csrs, dense, labels)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    stacks = len(model.ebc.kernel.stacks)
    assert stacks == 2 and code.count("torch.ops.tpurec.fused_lookup") == stacks


@pytest.mark.slow
def test_compiled_step_equals_eager_inductor():
    # inductor reorders float32 sums in the dense part (the loss): equal within 1e-6, not bit for bit.
    # The dense update runs after the compiled step: torch 2.14.1's inductor, with trace_autograd_ops,
    # applies `w.add_(w.grad, alpha=-lr)` to a Linear's weight wrongly inside the graph (a plain
    # Linear shows it; aot_eager does not), so only fwd + bwd + the fused update are compiled here.
    model, twin, eager, compiled, counter = _train_pair("rowwise_adagrad", "inductor", dense_in_graph=False)
    assert counter.frame_count == 1
    _assert_same_training(model, twin, eager, compiled, tol=1e-6)


def test_compiled_lookup_refuses_multipass_inputs():
    torch.manual_seed(0)
    tables = make_tables()
    ebc = SparseCoreEmbeddingBagCollection(
        tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2, device="cpu", max_ids_per_partition=8
    )
    kjt = random_kjt(tables, 64, torch.Generator().manual_seed(1), hot_ids=True)  # over the limit of 8
    csrs = ebc.kernel.preprocess(kjt)
    step = torch.compile(lambda c: ebc.kernel.lookup(c, 64).sum(), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="MultiPassInput"):
        step(csrs)


def test_compiled_step_through_the_tpu_adapter_on_the_standin():
    # The TPU adapter's kernels (TorchTPU's op calls, tpurec/embedding/tpu.py and each optimizer's
    # tpu_update) as the ops' CPU kernels, over the TorchTPU stand-in: the compiled step reaches
    # them from inside the graph, with the eager step's numbers and one TorchTPU program per stack and op.
    standin = tpu_standin.install(sparsecores=2)
    with tpu_standin.adapter_on_cpu():
        model, twin, eager, compiled, counter = _train_pair("adam", "aot_eager")
    assert counter.frame_count == 1
    _assert_same_training(model, twin, eager, compiled, tol=1e-6)
    keys = standin.compile_keys()
    assert len(keys) == 2 * len(model.ebc.kernel.stacks), sorted(keys)  # a lookup and an update per stack
    assert all(count == 2 * STEPS for count in keys.values())  # eager and compiled steps, same programs
    # leaving the block puts the reference back as the ops' CPU kernel (the direct CPU step checks it)
    assert ops.reference_is_cpu_kernel()


def test_opcheck_fused_lookup_and_update():
    # torch.library's own checks of the two ops: schema (the update's declared mutations are the
    # only ones), fake kernels against real ones, the autograd registration, and AOT dispatch.
    torch.manual_seed(0)
    tables = make_tables()
    ebc = SparseCoreEmbeddingBagCollection(
        tables, torch.optim.Adagrad, {"lr": 0.1}, num_sparsecores=2, device="cpu", max_ids_per_partition=64
    )
    kernel = ebc.kernel
    csr = kernel.preprocess(random_kjt(tables, BATCH, torch.Generator().manual_seed(0)))[0]
    tensors = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, kernel.stack_weight(0).clone())
    states = [kernel.stack_state(0, s).clone() for s in kernel.optimizer.state_names]
    ints = (csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions, 64, 64, kernel.custom_op_key, 0)
    trigger = torch.empty(0, requires_grad=True)
    feed = kernel.step_feed
    kernel.begin_compiled_step()  # (its autograd check runs the update)
    results = torch.library.opcheck(torch.ops.tpurec.fused_lookup.default, (trigger, *tensors, states, feed, *ints))
    assert set(results.values()) == {"SUCCESS"}, results
    grad = torch.randn(csr.device_batch_size, tensors[-1].shape[1])
    results = torch.library.opcheck(torch.ops.tpurec.fused_update.default, (grad, *tensors, states, feed, *ints))
    assert set(results.values()) == {"SUCCESS"}, results


def test_compiled_lookup_without_grad_equals_eager():
    # evaluation: no trigger, the plain lookup op; the eager lookup (the direct CPU reference) as oracle
    torch.manual_seed(0)
    tables = make_tables()
    model = TinyModel(tables, *fused_optimizers()["sgd"])
    lookup = torch.compile(model.ebc.kernel.lookup, fullgraph=True, dynamic=False, backend="aot_eager")
    for kjt, _, _ in _batches(tables)[:2]:
        with torch.no_grad():
            want = model.ebc(kjt).values()
            got = lookup(model.ebc.kernel.preprocess(kjt), BATCH)
        assert not got.requires_grad
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for name, before in model.initial_tables.items():
        assert torch.equal(model.ebc.kernel.read_weight(name), before)  # no update without grad


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torchrec_dlrm_step_compiles_with_preprocessed_features(backend):
    # TorchRec's own DLRM with tpurec's EBC as its embedding_bag_collection: the model is called with
    # the EBC's `preprocess(kjt)` in place of the KJT, so the whole step (sparse arch, interaction,
    # over arch, loss, backward with fused updates, dense SGD) is one graph; oracle: the eager step
    # on the KJT. Inductor: within 1e-6 (float32 sums reordered), the dense SGD after the graph (see
    # test_compiled_step_equals_eager_inductor).
    from torchrec.models.dlrm import DLRM
    from torchrec.optim import RowWiseAdagrad

    tol, dense_in_graph = (0.0, True) if backend == "aot_eager" else (1e-6, False)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate([40, 100, 7])
    ]
    torch.manual_seed(0)
    ebc = SparseCoreEmbeddingBagCollection(
        tables, RowWiseAdagrad, {"lr": 0.1}, num_sparsecores=2, device="cpu", max_ids_per_partition=64
    )
    model = DLRM(
        embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]
    )
    twin = copy.deepcopy(model)
    twin_ebc = twin.sparse_arch.embedding_bag_collection
    initial = {name: ebc.kernel.read_weight(name).clone() for name in ebc.kernel.table_names}

    def dense_sgd(m: DLRM) -> None:
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:  # the tables never get one: the fused update took it
                    p.add_(p.grad, alpha=-DENSE_LR)
                    p.grad = None

    def step(m: DLRM, dense: torch.Tensor, features: Any, labels: torch.Tensor, sgd: bool) -> torch.Tensor:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(m(dense, features).squeeze(1), labels)
        loss.backward()
        if sgd:
            dense_sgd(m)
        return loss.detach()

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        kjt = random_kjt(tables, 16, gen)
        dense, labels = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen).float()
        want = step(model, dense, kjt, labels, True)
        features = twin_ebc.preprocess(kjt)
        twin_ebc.kernel.begin_compiled_step()  # the eager half: the update's count and scalars
        got = compiled(twin, dense, features, labels, dense_in_graph)
        if not dense_in_graph:
            dense_sgd(twin)
        assert abs(float(got) - float(want)) <= tol
    assert counter.frame_count == 1
    for name in ebc.kernel.table_names:
        torch.testing.assert_close(twin_ebc.kernel.read_weight(name), ebc.kernel.read_weight(name), atol=tol, rtol=0)
        assert not torch.equal(ebc.kernel.read_weight(name), initial[name])
    dense_params = {n: p for n, p in model.named_parameters() if "embedding_bags" not in n}
    twin_params = dict(twin.named_parameters())
    assert len(dense_params) == 8  # two layers in each MLP, weight and bias
    for n, p in dense_params.items():
        torch.testing.assert_close(twin_params[n], p, atol=tol, rtol=0)


def test_a_compiled_update_without_a_begun_step_is_refused():
    # On a TPU the update op's Python runs once, when the graph is compiled: it cannot count steps or
    # read the lr itself (tpurec/embedding/step_scalars.py). A step whose eager half did not begin it
    # would train on no scalars at all: refused, naming the call it lacks.
    model, csrs, dense, labels = _first_batch("sgd")
    step = torch.compile(_device_half(model), fullgraph=True, dynamic=False, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"without SparseCoreKernel.begin_compiled_step\(\)"):
        step(csrs, dense, labels)


def test_begin_compiled_step_counts_the_step_and_feeds_the_groups_lr():
    # Adam: its bias-corrected step size changes every step; the feed holds it for the step begun, at
    # the param group's lr then (a scheduler's move included), as float32, one row per stack.
    from tpurec.embedding.optimizers.adam import alpha_t

    torch.manual_seed(0)
    tables = make_tables()
    model = TinyModel(tables, *fused_optimizers()["adam"])
    kernel = model.ebc.kernel
    for step in (1, 2):
        if step == 2:
            cast(dict, model.ebc.fused_optimizer.param_groups[0])["lr"] = 0.004
        kernel.begin_compiled_step()
        lr = 0.01 if step == 1 else 0.004
        assert all(kernel.step_count(name) == step for name in kernel.table_names)
        want = [alpha_t(lr, 0.9, 0.999, step), 0.9, 0.999, 1e-6, 1 - 0.9, 1 - 0.999]
        for i in range(len(kernel.stacks)):
            assert kernel.take_step_feed(i)[0] == lr
            assert torch.equal(kernel.step_feed[i], torch.tensor([lr, *want], dtype=torch.float32))
