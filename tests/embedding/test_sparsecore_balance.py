"""The stacked batch is interleaved per SparseCore, as TorchTPU lays it out.

Each SparseCore takes its slice of every feature's samples (torchrec's TPU module un-interleaves the
op's rows as [SparseCores, features, batch / S, dim]), so a stack's heavy feature is spread over all
SparseCores instead of landing whole on one of them.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding import reference
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.optimizers.sgd import SGDSpec

NUM_SC = 4


def _kernel(**kw):
    tables = [KernelTable("light", 5000, 8, ("fl",)), KernelTable("heavy", 7000, 8, ("fh",))]
    return SparseCoreKernel(tables, SGDSpec(lr=0.1), NUM_SC, **kw)


def _kjt(batch: int, pooling: dict[str, int], gen: torch.Generator) -> KeyedJaggedTensor:
    """Every sample of a feature has the same number of ids, all ids of a feature distinct."""
    rows = {"fl": 5000, "fh": 7000}
    values = [torch.randperm(rows[f], generator=gen)[: batch * k] for f, k in pooling.items()]
    lengths = [torch.full((batch,), k) for k in pooling.values()]
    return KeyedJaggedTensor(keys=list(pooling), values=torch.cat(values), lengths=torch.cat(lengths))


@pytest.mark.parametrize("compiled", [True, False])
def test_every_sparsecore_gets_its_share_of_every_feature(compiled, monkeypatch):
    if not compiled:
        monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    kernel = _kernel()
    batch, pooling = 64, {"fl": 1, "fh": 30}
    kernel.preprocess(_kjt(batch, pooling, torch.Generator().manual_seed(0)))
    stats = next(iter(kernel.last_stats.values()))
    per_sc = stats.ids_per_partition.sum(1)
    # 64 * 31 ids over 4 SparseCores: 16 samples of each feature, 496 ids each. Feature-major
    # slices gave SparseCores 0-1 the light feature (32 ids each) and 2-3 the heavy one (960 each).
    assert per_sc.tolist() == [batch * sum(pooling.values()) // NUM_SC] * NUM_SC


def _torchrec_unstack_activation():
    """torchrec's own `_unstack_activation` (experimental/torch_tpu), compiled from its source: the
    module itself imports TorchTPU's C++ preprocessing at import time, which is not installed here."""
    import torchrec

    path = os.path.join(
        os.path.dirname(torchrec.__file__), "experimental", "torch_tpu", "modules", "fused_embedding_modules.py"
    )
    if not os.path.exists(path):
        pytest.skip(f"{path} not in this torchrec")
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_unstack_activation":
            node.decorator_list = []
            node.returns = None
            for a in node.args.args:
                a.annotation = None
            scope = {"torch": torch}
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), scope)
            return scope["_unstack_activation"]
    pytest.skip(f"_unstack_activation not found in {path}")


def test_op_rows_unstack_as_torchrec_tpu_module_does():
    unstack = _torchrec_unstack_activation()
    kernel = _kernel()
    batch = 10  # padded to 12: the padding samples sit at the end of every SparseCore's slice
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 5, (2 * batch,), generator=gen)
    values = torch.cat(
        [torch.randint(0, r, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=gen)
         for k, r in enumerate((5000, 7000))]
    )  # fmt: skip
    kjt = KeyedJaggedTensor(keys=["fl", "fh"], values=values, lengths=lengths)
    (csr,) = kernel.preprocess(kjt)
    raw = reference.lookup_csr(
        csr.row_pointers,
        csr.embedding_ids,
        csr.sample_ids,
        csr.gains,
        kernel.stack_weight(0),
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
    )  # fmt: skip  (the op's rows, [2 * 12, 8])
    owner = type("SparseCoreModule", (), {"_num_sc_per_device": NUM_SC})()
    per_feature = unstack(owner, raw, 2, 12)  # [features, padded batch, dim]
    with torch.no_grad():
        out = kernel.lookup([csr], batch)
    assert torch.equal(out, per_feature[:, :batch].transpose(0, 1).reshape(batch, 16))
    assert out.abs().sum() > 0 and not per_feature[:, batch:].any()
