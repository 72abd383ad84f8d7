"""The compiled step (tpurec/sharding/step/compiled.py) on a model holding a tpurec-sharded
FeatureProcessedEmbeddingBagCollection of PositionWeightedModules (tpurec/sharding/fp_preprocess.py):
the position weights are dense parameters trained inside the graph. The oracle is TorchRec's eager
step of a twin DMP (same seed, same batches, same starting position weights): DMP's forward (the FP
module's feature processors, the SparseCore kernel's weight gradient, weight_grad.py), DDP's average
and torch.optim.SGD over every dense parameter, position weights included. With aot_eager every loss,
table, dense weight and position weight is bit-equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.helpers.dlrm_step import table_shards

from .dlrm_case import DENSE, DIM, eager_step, table_configs

STEPS, BATCH, DENSE_LR, TABLE_LR = 12, 16, 0.05, 0.1
ROWS, MAX_LENGTH = 24, 4  # few rows: a bag often holds an id twice (one merged SparseCore entry)
START = torch.tensor([1.0, 0.5, 1.5, 0.75])  # the position weights' start, for both twins


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class FPModel(nn.Module):
    """An FP-EBC (tables t0, t1 of f0, f1, position-weighted), with a plain EBC (t2 of f2) when `plain`,
    and a linear model over their pooled embeddings and the dense features; forward returns (loss,
    logits) as TorchRec's DLRMTrain does."""

    def __init__(self, plain: bool = False, pooling: str = "SUM") -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.modules.feature_processor_ import PositionWeightedModule
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        super().__init__()
        ebc = EmbeddingBagCollection(
            table_configs(2, pooling, rows=ROWS), is_weighted=True, device=torch.device("meta")
        )
        self.fp = FeatureProcessedEmbeddingBagCollection(
            ebc, {f"f{i}": PositionWeightedModule(MAX_LENGTH) for i in range(2)}
        )
        self.plain = None
        if plain:
            # weighted by the batch's own weights (not trainable): the lookup's gains as today
            config = EmbeddingBagConfig(name="t2", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f2"])
            self.plain = EmbeddingBagCollection([config], is_weighted=True, device=torch.device("meta"))
        self.dense = nn.Linear(DENSE, DIM)
        self.over = nn.Linear((4 if plain else 3) * DIM, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.dense(batch.dense_features), self.fp(batch.sparse_features).values()]
        if self.plain is not None:
            parts.append(self.plain(batch.sparse_features).values())
        logits = self.over(torch.cat(parts, dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def _dmp(plain: bool = False, pooling: str = "SUM", types: dict[str, str] | None = None) -> Any:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.sharding.fp_sharder import SparseCoreFPEBCSharder
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    torch.manual_seed(0)
    model = FPModel(plain, pooling)
    tables = [*model.fp._embedding_bag_collection.parameters()]
    if model.plain is not None:
        tables += model.plain.parameters()
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": TABLE_LR})
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in (types or {}).items()} or None
    dmp = tpurec.DistributedModelParallel(
        model,
        device="cpu",
        batch_size=BATCH,
        constraints=constraints,
        sharders=[SparseCoreFPEBCSharder(max_ids_per_partition=64), SparseCoreEBCSharder(max_ids_per_partition=64)],
    )
    with torch.no_grad():
        for name, p in dmp.named_parameters():
            if name.endswith("position_weight"):
                p.copy_(START * (2 if ".f1." in name else 1))
    return dmp


def _batches(plain: bool = False, rank: int = 0, world_size: int = 1) -> list[Batch]:
    """Multi-hot bags of 0..MAX_LENGTH ids (every position occurs), ids repeating within bags; with
    `plain`, f2 too and weights for every id (the FP module replaces those of f0, f1 by its own)."""
    gen = torch.Generator().manual_seed(7)
    keys = ["f0", "f1", "f2"] if plain else ["f0", "f1"]
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, MAX_LENGTH + 1, (world_size, len(keys), BATCH), generator=gen)[rank]
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        weights = torch.rand(values.numel(), generator=gen) if plain else None
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1), weights=weights)
        dense = torch.randn(world_size, BATCH, DENSE, generator=gen)[rank]
        labels = torch.randint(0, 2, (world_size, BATCH), generator=gen)[rank].float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _position_weights(dmp: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in dmp.named_parameters() if n.endswith("position_weight")}


def _train(rank: int = 0, world_size: int = 1, plain: bool = False, pooling: str = "SUM", types=None) -> dict:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.sharding.step.compiled import CompiledStep

    eager, twin = _dmp(plain, pooling, types), _dmp(plain, pooling, types)
    initial, initial_pw = table_shards(eager), _position_weights(eager)
    dense = [p for _, p in in_backward_optimizer_filter(eager.named_parameters())]
    sgd = torch.optim.SGD(dense, lr=DENSE_LR)
    eager_losses = [eager_step(eager, sgd, b) for b in _batches(plain, rank, world_size)]
    counter = CompileCounterWithBackend("aot_eager")
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    losses = [float(step.step(b)) for b in _batches(plain, rank, world_size)]
    after, twin_after = table_shards(eager), table_shards(twin)
    pw, twin_pw = _position_weights(eager), _position_weights(twin)
    twin_dense = [p for _, p in in_backward_optimizer_filter(twin.named_parameters())]
    return {
        "modules": len(step.fields.modules),
        "eager": eager_losses,
        "stepped": losses,
        "frames": counter.frame_count,
        "table_diff": max(float((after[k] - twin_after[k]).abs().max()) for k in after),
        "tables": sorted(after),
        "tables_moved": min(float((twin_after[k] - initial[k]).abs().max()) for k in after),
        "pw": sorted(pw),
        "pw_diff": max(float((pw[k] - twin_pw[k]).abs().max()) for k in pw),
        "pw_moved": min(float((twin_pw[k] - initial_pw[k]).abs().max()) for k in pw),
        "dense_diff": max(float((p - q).detach().abs().max()) for p, q in zip(dense, twin_dense, strict=True)),
        "plan": sorted({ps.sharding_type for mp in twin.plan.plan.values() for ps in mp.values()}),
    }


def _assert_exact(result: dict, modules: int = 1) -> None:
    assert result["modules"] == modules
    assert result["frames"] == 1  # one graph for every step
    assert result["stepped"] == result["eager"]  # bit-equal, every step
    assert result["table_diff"] == 0.0 and result["dense_diff"] == 0.0
    assert result["pw_diff"] == 0.0  # the position weights too
    assert result["tables_moved"] > 1e-3 and result["pw_moved"] > 1e-4  # everything trained


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_compiled_fp_ebc_step_as_the_eager_step(pooling):
    result = _train(pooling=pooling)
    assert len(result["tables"]) == 2 and len(result["pw"]) == 2
    _assert_exact(result)


def test_compiled_fp_ebc_beside_a_weighted_ebc():
    """An FP-EBC and a plain EBC weighted by the batch's weights (untrainable gains, as before) handed
    the one KJT: both stepped in the one graph, bit-equal."""
    result = _train(plain=True)
    assert len(result["tables"]) == 3
    _assert_exact(result, modules=2)


def test_compiled_fp_ebc_step_is_one_graph_without_breaks():
    from tpurec.sharding.step.compiled import CompiledStep

    step = CompiledStep(_dmp(), DENSE_LR)
    explained = step.explain(_batches()[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("fused_lookup" in op for op in ops) == 1  # t0 and t1 in one stack, one lookup op
    assert any("gather" in op for op in ops)  # the position weights gathered in the graph


@pytest.mark.slow  # two gloo ranks importing torchrec and compiling: 40-60 s each on a shared host
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "types",
    [
        {"t0": "row_wise", "t1": "table_wise", "t2": "column_wise"},
        {"t0": "column_wise", "t1": "table_row_wise", "t2": "row_wise"},
    ],
)
def test_compiled_fp_ebc_on_two_ranks(types):
    """Two gloo ranks, every sharding type over the FP-EBC's tables: row-wise ids are tagged with their
    positions before they are bucketed (TorchRec's pre-processing); the weights' gradient is scaled
    back up by the world size as TorchRec's lookup scales it; the position weights' gradients are
    averaged with the other dense ones in the graph."""
    from .multiprocess import run_ranks

    results = run_ranks(_train, 2, True, "SUM", types, timeout=600)
    for rank, result in enumerate(results):
        assert result["plan"] == sorted(set(types.values())), rank
        _assert_exact(result, modules=2)
    assert len({t for r in results for t in r["tables"]}) == 3  # (a TW table lives on one rank)
