"""The sides of an embedding training-step comparison, built on the same tables and optimizer.

A step is forward + backward + the fused update on one KJT (preprocessing included for tpurec),
with a fixed upstream gradient. Every side exposes the same surface, so the equal-work check
(`tpurec.bench.equal_work`) and the timer treat them alike:

* tpurec: SparseCoreEmbeddingBagCollection on the CPU reference;
* fbgemm: FBGEMM's CPU TBE (SplitTableBatchedEmbeddingBagsCodegen, the optimizer's EXACT_* kind);
* torch-sparse-adam: for Adam, which FBGEMM's CPU TBE refuses ("Optimizer adam is not supported
  in CPU mode"; so does stock TorchRec's fused kernel, which is that TBE): one nn.EmbeddingBag
  (sparse=True) holding every table, rows concatenated as FBGEMM stacks them, with
  torch.optim.SparseAdam. SparseAdam is lazy and adds a constant epsilon to sqrt(v) with the bias
  correction in the step size, exactly tpurec's Adam. (TorchRec's unsharded EBC with
  torch.optim.Adam would update every row of every table each step: other work, other results.)

The peer starts from tpurec's initial tables (copied), so one step on the same ids must give the
same tables on both sides. FBGEMM's weights and optimizer state are moved onto transparent huge pages,
as tpurec's own tables are (`tpurec.embedding.huge_pages`): both sides under the same memory conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# optimizer name -> (torch/TorchRec optimizer path, kwargs, FBGEMM EmbOptimType name or None)
OPTIMIZERS: dict[str, tuple[str, dict, str | None]] = {
    "sgd": ("torch.optim.SGD", {"lr": 0.01}, "EXACT_SGD"),
    "adagrad": ("torch.optim.Adagrad", {"lr": 0.01, "eps": 1e-8}, "EXACT_ADAGRAD"),
    "rowwise_adagrad": ("torchrec.optim.RowWiseAdagrad", {"lr": 0.01, "eps": 1e-8}, "EXACT_ROWWISE_ADAGRAD"),
    "adam": ("torch.optim.Adam", {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8}, None),
}
PEERS = {
    "fbgemm": "FBGEMM CPU TBE (SplitTableBatchedEmbeddingBagsCodegen)",
    "torch-sparse-adam": "nn.EmbeddingBag(sparse=True, tables concatenated) + torch.optim.SparseAdam "
    "(FBGEMM's CPU TBE refuses ADAM on CPU)",
}


def peer_of(optimizer: str) -> str:
    return "fbgemm" if OPTIMIZERS[optimizer][2] else "torch-sparse-adam"


@dataclass
class Side:
    """step(kjt, upstream) runs one training step and returns the pooled output [batch, sum of dims];
    tables() returns every table, natural row order, as the side holds it."""

    name: str
    step: Callable
    tables: Callable[[], list]


def _optimizer_class(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def tpurec_side(num_tables: int, rows: int, dim: int, optimizer: str, extra: dict | None = None) -> Side:
    """extra: more optimizer kwargs (weight decay, `tpurec.bench.decay`)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    path, kwargs, _ = OPTIMIZERS[optimizer]
    kwargs = kwargs | (extra or {})
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    m = SparseCoreEmbeddingBagCollection(configs, _optimizer_class(path), kwargs, num_sparsecores=4, device="cpu")
    if list(m.kernel.feature_order) != [f"f{i}" for i in range(num_tables)]:
        raise AssertionError(f"tpurec's output order {m.kernel.feature_order} is not the tables' order")

    def step(kjt, upstream):
        out = m(kjt).values()
        out.backward(upstream)
        return out.detach()

    return Side("tpurec", step, lambda: [m.table_weight(c.name) for c in configs])


def fbgemm_side(optimizer: str, initial: list) -> Side:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from tpurec.embedding import huge_pages

    _, kwargs, kind = OPTIMIZERS[optimizer]
    assert kind is not None, f"FBGEMM's TBE has no {optimizer}"  # peer_of picks another contender then
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU) for w in initial],
        optimizer=getattr(EmbOptimType, kind),
        learning_rate=kwargs["lr"],
        eps=kwargs.get("eps", 1e-8),
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        for w, src in zip(tbe.split_embedding_weights(), initial):
            w.copy_(src)
    # Its weights and optimizer state on huge pages, as tpurec's (huge_pages.py): from torch's
    # allocator they got them only where the process's history did (docs/results.md, session 38).
    for name in ("weights_host", "momentum1_host", "momentum2_host"):
        if isinstance(getattr(tbe, name, None), torch.Tensor):
            huge_pages.move_onto(getattr(tbe, name))

    def step(kjt, upstream):
        out = tbe(kjt.values(), kjt.offsets())
        out.backward(upstream)
        return out.detach()

    return Side("fbgemm", step, lambda: list(tbe.split_embedding_weights()))


def torch_sparse_adam_side(optimizer: str, initial: list) -> Side:
    import torch

    _, kwargs, _ = OPTIMIZERS[optimizer]
    rows = [w.shape[0] for w in initial]
    dim = initial[0].shape[1]
    bag = torch.nn.EmbeddingBag(sum(rows), dim, mode="sum", sparse=True, include_last_offset=True)
    with torch.no_grad():
        bag.weight.copy_(torch.cat(initial))
    opt = torch.optim.SparseAdam(bag.parameters(), lr=kwargs["lr"], betas=kwargs["betas"], eps=kwargs["eps"])
    starts = torch.tensor([0, *rows[:-1]]).cumsum(0)
    num_tables = len(rows)

    def step(kjt, upstream):
        # Each feature's ids shifted to its table's rows (FBGEMM does the same with hash_size_cumsum).
        shift = torch.repeat_interleave(starts, torch.tensor(kjt.length_per_key()))
        out = bag(kjt.values() + shift, kjt.offsets())  # [tables * batch, dim], table-major
        out = out.view(num_tables, -1, dim).transpose(0, 1).reshape(-1, num_tables * dim)
        out.backward(upstream)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()

    return Side("torch-sparse-adam", step, lambda: list(bag.weight.detach().split(rows)))


def build(num_tables: int, rows: int, dim: int, optimizer: str) -> tuple[Side, Side]:
    """(tpurec, peer) on the same initial tables."""
    ours = tpurec_side(num_tables, rows, dim, optimizer)
    initial = [w.detach().clone() for w in ours.tables()]
    peer = fbgemm_side if peer_of(optimizer) == "fbgemm" else torch_sparse_adam_side
    theirs = peer(optimizer, initial)
    del initial
    return ours, theirs
