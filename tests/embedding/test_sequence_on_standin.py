"""The sequence (EmbeddingCollection) kernel through the TPU adapter, on CPU via the TorchTPU stand-in.

Unpooled lookups use the same TorchTPU ops as pooled ones (each id its own bag, gain 1), so the
adapter is the EBC's; what is new and checked here: outputs and fused updates through TorchTPU's
conventions equal the reference for every optimizer, and sequences of changing lengths keep every
buffer shape fixed (one compiled program per stack and op, as a TPU needs)."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection
from tpurec.emulation import torchtpu_ops as tpu_standin

from .helpers import fused_optimizers

NUM_SC = 4
BATCH = 8
TABLES = [
    EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=301, feature_names=["history", "candidate"]),
    EmbeddingConfig(name="cats", embedding_dim=16, num_embeddings=40, feature_names=["categories"]),
]
ROWS = {"history": 301, "candidate": 301, "categories": 40}


def _batch(gen, step):
    """Sequences whose lengths change every step (0..12 ids), some users with an empty history."""
    values, lengths = [], []
    for key, rows in ROWS.items():
        lens = torch.randint(0, 13 if key == "history" else 3, (BATCH,), generator=gen)
        if step % 4 == 3:
            lens[: BATCH // 2] = 0
        values.append(torch.randint(0, rows, (int(lens.sum()),), generator=gen))
        lengths.append(lens)
    return KeyedJaggedTensor(keys=list(ROWS), values=torch.cat(values), lengths=torch.cat(lengths))


def _model(name):
    optim, kwargs = fused_optimizers()[name]
    torch.manual_seed(0)
    # Capacity for 12 ids x 8 users per feature and id limits for all of them: fixed, so shapes never change.
    return SparseCoreEmbeddingCollection(
        TABLES,
        optim,
        kwargs,
        num_sparsecores=NUM_SC,
        device="cpu",
        fixed_limits=True,
        max_ids_per_feature=96,
        max_ids_per_partition=3 * 96,
    )


def _train(model, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps):
        out = model(_batch(gen, step))
        outs.append({k: v.values().detach().clone() for k, v in out.items()})
        sum((v.values() * torch.randn(v.values().shape, generator=gen)).sum() for v in out.values()).backward()
    return outs


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_sequence_lookups_through_torchtpu_semantics_equal_the_reference(name):
    reference = _model(name)
    ref_outs = _train(reference, 5)
    standin = tpu_standin.install(sparsecores=NUM_SC)
    adapted = _model(name)
    with tpu_standin.adapter_on_cpu():
        outs = _train(adapted, 5)
    assert standin.calls, "the adapter never reached TorchTPU's ops"
    for a, b in zip(outs, ref_outs):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    for t in ("items", "cats"):
        torch.testing.assert_close(adapted.table_weight(t), reference.table_weight(t), rtol=0, atol=0)


def test_changing_sequence_lengths_compile_one_program_per_stack_and_op():
    standin = tpu_standin.install(sparsecores=NUM_SC)
    model = _model("rowwise_adagrad")
    with tpu_standin.adapter_on_cpu():
        _train(model, 20, seed=3)
    keys = standin.compile_keys()
    stacks = len(model.kernel.stacks)
    lookups = [k for k in keys if k[0] == "_sparse_dense_matmul"]
    updates = [k for k in keys if k[0] != "_sparse_dense_matmul"]
    assert len(lookups) == stacks and len(updates) == stacks, sorted(keys.values())
    assert all(count == 20 for count in keys.values())


def test_outputs_of_changing_id_counts_need_no_new_device_program():
    """On a TPU every tensor op on the lookup's output compiles one program per input shape. The
    lookup is [capacity, features * dim] whatever the batch; each feature's rows must come out of it
    as views (a prefix), never through an op shaped by the batch's id count (the gather that was
    here made a new program for every count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dim = TABLES[0].embedding_dim

    class Programs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.keys = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            # Device work on embeddings: float ops on [.., dim] tensors that are not views.
            if not func.is_view and any(t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == dim for t in tensors):
                self.keys.add((str(func), tuple(tuple(t.shape) for t in tensors)))
            return func(*args, **(kwargs or {}))

    tpu_standin.install(sparsecores=NUM_SC)
    model = _model("sgd")
    gen = torch.Generator().manual_seed(5)
    with tpu_standin.adapter_on_cpu(), torch.no_grad():
        model(_batch(gen, 0))
        with Programs() as mode:
            model(_batch(gen, 1))
        first = set(mode.keys)
        with Programs() as mode:
            for step in range(2, 8):  # other id counts per feature, empty histories at step 3 and 7
                model(_batch(gen, step))
    assert mode.keys <= first, sorted(mode.keys - first)
