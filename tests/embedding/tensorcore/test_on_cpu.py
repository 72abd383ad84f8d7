"""`torch_ops.on_cpu()`: a module trains through the JAX kernels as it does through the reference,
and a new learning rate is a runtime argument, never a recompile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax")

from tpurec.embedding import ops  # noqa: E402
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection  # noqa: E402
from tpurec.embedding.optimizers import adam  # noqa: E402
from tpurec.embedding.tensorcore import programs, torch_ops  # noqa: E402

from ..helpers import fused_optimizers, make_tables, random_kjt  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402

NUM_SC, BATCH = 2, 8


def _model(name: str) -> SparseCoreEmbeddingBagCollection:
    optim, kwargs = fused_optimizers()[name]
    torch.manual_seed(0)
    return SparseCoreEmbeddingBagCollection(
        make_tables(), optim, kwargs, num_sparsecores=NUM_SC, is_weighted=True, device="cpu", fixed_limits=True
    )


def _train(model: SparseCoreEmbeddingBagCollection, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(steps):
        out = model(random_kjt(make_tables(), BATCH, gen, weighted=True)).values()
        outs.append(out.detach().clone())
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return outs


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_module_trains_through_the_jax_kernels_as_through_the_reference(name, monkeypatch):
    reference = _model(name)
    want = _train(reference)
    ran: list[str] = []
    program = programs.program
    monkeypatch.setattr(programs, "program", lambda kind, *layout: ran.append(kind) or program(kind, *layout))
    jax_model = _model(name)
    with torch_ops.on_cpu():
        assert not ops.reference_is_cpu_kernel()  # so the direct CPU step, which bypasses the ops, is off
        got = _train(jax_model)
    assert ops.reference_is_cpu_kernel()  # the reference restored
    assert "lookup" in ran and {"sgd", "adagrad", "adam"} & set(ran), ran
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kernel = jax_model.kernel
    for t in jax_model.embedding_bag_configs():
        torch.testing.assert_close(jax_model.table_weight(t.name), reference.table_weight(t.name), rtol=1e-5, atol=1e-6)
        for s in kernel.optimizer.state_names:
            got_state, want_state = kernel.read_state(t.name, s), reference.kernel.read_state(t.name, s)
            torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)


def test_a_new_learning_rate_or_adam_step_does_not_recompile():
    case = Case(num_sc=2, pooling="weighted", rows=100, features=2, batch=6)
    gen = torch.Generator().manual_seed(0)
    t = table(case, gen)
    m, v = torch.zeros_like(t), torch.zeros_like(t)
    for kind, lrs in (("sgd", (0.1, 0.05, 0.02)), ("adam", (0.01, 0.003, 0.001))):
        before = None
        for step, lr in enumerate(lrs, start=1):
            csr = csr_input(case, gen)
            grad = torch.randn(case.device_batch_size, case.width, generator=gen)
            if kind == "sgd":
                torch_ops.sgd_update(*head(csr), t, grad, lr, *tail(csr))
            else:
                a = adam.alpha_t(lr, 0.9, 0.999, step)
                torch_ops.adam_update(*head(csr), t, m, v, grad, a, 0.9, 0.999, 1e-8, *tail(csr))
            if before is None:  # the first call may compile (or find the program compiled)
                before = programs.trace_counts[kind]
        assert programs.trace_counts[kind] == before, f"{kind} traced again for a new learning rate"
        assert programs.program(kind, *tail(csr)[:3], tail(csr)[4])._cache_size() == 1
