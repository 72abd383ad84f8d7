"""The compiled and pipelined steps on a model of two sharded EmbeddingBagCollections
(tpurec/sharding/step/inputs.py): both handed the batch's one KJT (each takes its own features), or
each a KJT field of its own. The oracle is TorchRec's eager step of a twin DMP (same seed, same
batches): with aot_eager and, for the pipelined step, batches whose consecutive rows are disjoint,
every loss, table and dense weight is bit-equal (as tests/sharding/test_compiled_dmp_step.py and
test_pipelined_step.py assert for one EBC).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.helpers.dlrm_step import BATCH, DENSE_LR, MIXED, TABLE_LR, disjoint_batches, fixed_limits_dmp, table_shards
from tests.helpers.two_ebcs import TwoEBCs, TwoFields

from .dlrm_case import DIM, ROWS, eager_step
from .multiprocess import run_ranks

STEPS = 12


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dmp(fields: str, types: dict[str, str] | None = None) -> Any:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)
    model = TwoEBCs(fields)
    tables = [*model.items.parameters(), *model.users.parameters()]
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": TABLE_LR})
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in (types or {}).items()} or None
    return fixed_limits_dmp(model, constraints)


def _batches(fields: str, rank: int = 0, world_size: int = 1) -> list:
    """dlrm_case's batches (consecutive ones on disjoint rows); with "split", f2 and f3 in a field of their own."""
    out = disjoint_batches(STEPS, BATCH, rank, world_size)
    if fields == "shared":
        return out
    split = []
    for b in out:
        items, users = b.sparse_features.split([2, 2])
        split.append(TwoFields(b.dense_features, items, users, b.labels))
    return split


def _train(rank: int, world_size: int, fields: str, kind: str, types: dict[str, str] | None = None) -> dict:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.pipelined import PipelinedStep

    eager, twin = _dmp(fields, types), _dmp(fields, types)
    initial = table_shards(eager)
    dense = [p for _, p in in_backward_optimizer_filter(eager.named_parameters())]
    sgd = torch.optim.SGD(dense, lr=DENSE_LR)
    eager_losses = [eager_step(eager, sgd, b) for b in _batches(fields, rank, world_size)]
    counter = CompileCounterWithBackend("aot_eager")
    if kind == "compiled":
        step = CompiledStep(twin, DENSE_LR, backend=counter)
        losses = [float(step.step(b)) for b in _batches(fields, rank, world_size)]
        modules = step.fields.modules
    else:
        pipe = PipelinedStep(twin, DENSE_LR, backend=counter)
        losses = [float(x) for x in pipe.iterate(_batches(fields, rank, world_size))]
        modules = pipe.fields.modules
    after, twin_after = table_shards(eager), table_shards(twin)
    twin_dense = [p for _, p in in_backward_optimizer_filter(twin.named_parameters())]
    return {
        "modules": len(modules),
        "eager": eager_losses,
        "stepped": losses,
        "frames": counter.frame_count,
        "table_diff": max(float((after[k] - twin_after[k]).abs().max()) for k in after),
        "tables": sorted(after),
        "tables_moved": min(float((twin_after[k] - initial[k]).abs().max()) for k in after),
        "dense_diff": max(float((p - q).detach().abs().max()) for p, q in zip(dense, twin_dense, strict=True)),
        "plan": sorted({ps.sharding_type for mp in twin.plan.plan.values() for ps in mp.values()}),
    }


@pytest.mark.parametrize("kind", ["compiled", "pipelined"])
@pytest.mark.parametrize("fields", ["shared", "split"])
def test_two_sharded_ebcs_step_as_the_eager_step(fields, kind):
    result = _train(0, 1, fields, kind)
    assert len(result["tables"]) == 4  # every table of both EBCs compared
    _assert_exact(result)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["compiled", "pipelined"])
def test_two_sharded_ebcs_on_two_ranks(kind):
    # two gloo ranks, TW, RW, CW and TWRW tables over the two EBCs: each EBC's input dist, in the
    # same order on every rank, and its output dists in the one graph
    results = run_ranks(_train, 2, "split", kind, MIXED, timeout=600)
    for rank, result in enumerate(results):
        assert result["plan"] == sorted(set(MIXED.values())), rank
        _assert_exact(result)
    assert len({t for r in results for t in r["tables"]}) == 4  # (a TW table lives on one rank)


def _assert_exact(result: dict) -> None:
    assert result["modules"] == 2
    assert result["frames"] == 1  # one graph for every step (the pipelined step's steady ones)
    assert result["stepped"] == result["eager"]  # bit-equal, every step
    assert result["table_diff"] == 0.0 and result["dense_diff"] == 0.0
    assert result["tables_moved"] > 1e-3  # every table was updated (a lost update: both at the start)


def test_a_batch_that_does_not_say_which_field_feeds_an_ebc_is_refused():
    from tpurec.errors import UserError
    from tpurec.sharding.step.compiled import CompiledStep

    step = CompiledStep(_dmp("split"), DENSE_LR)
    b = _batches("split")[0]
    # no field holds f2 and f3: the module named, with what the batch has
    f0 = b.sparse_features.split([1, 1])[0]
    with pytest.raises(UserError, match=r"every feature of the sharded EBC 'users' \(f2, f3\).*user_features: f0$"):
        step.step(TwoFields(b.dense_features, b.sparse_features, f0, b.labels))
    # two fields hold them: which one the model hands the EBC is not known
    both = _batches("shared")[0].sparse_features
    with pytest.raises(UserError, match=r"fields sparse_features, user_features all hold.*'items' \(f0, f1\)"):
        step.step(TwoFields(b.dense_features, both, both, b.labels))


def test_a_model_with_other_sharded_modules_is_refused_by_name():
    """An FP-EBC (its own forward runs the EBC inside it; the compiled step takes it:
    test_compiled_fp_step.py) in a pipelined step, or an EmbeddingCollection off its fixed-shape path
    (CPU's default): refused in one line naming each, before anything runs."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    import tpurec
    from tests.helpers.fp_model import FPModel
    from tpurec.errors import UserError
    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.pipelined import PipelinedStep

    fp = tpurec.DistributedModelParallel(FPModel(), device="cpu", batch_size=BATCH)
    with pytest.raises(
        UserError,
        match=r"PipelinedStep steps sharded EmbeddingBagCollections, EmbeddingCollections only.*"
        r"fp \(ShardedSparseCoreFPEBC\)",
    ):
        PipelinedStep(fp, DENSE_LR)
    assert CompiledStep(fp, DENSE_LR).fields.modules == [fp.module.fp]

    class WithEC(TwoEBCs):
        def __init__(self) -> None:
            super().__init__("shared")
            config = EmbeddingConfig(name="s0", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["s"])
            self.seq = EmbeddingCollection([config], device=torch.device("meta"))

    torch.manual_seed(0)
    ec = tpurec.DistributedModelParallel(WithEC(), device="cpu", batch_size=BATCH)
    with pytest.raises(UserError, match=r"CompiledStep: .*EmbeddingCollection \(seq\) on its fixed-shape output path"):
        CompiledStep(ec, DENSE_LR)
    with pytest.raises(UserError, match=r"PipelinedStep: .*EmbeddingCollection \(seq\).*fixed_limits=True"):
        PipelinedStep(ec, DENSE_LR)


class _ReadsTheKJT(TwoEBCs):
    """Reads its KJT's keys before handing it to the EBCs: it needs the KJT itself."""

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch.sparse_features.keys()) != 4:
            raise AssertionError("a batch of four features")
        return super().forward(batch)


@pytest.mark.parametrize("kind", ["compiled", "pipelined"])
def test_a_model_that_reads_its_kjt_gets_one_line_saying_so(kind, monkeypatch):
    """The steps hand the model's EBCs their SparseCore inputs in the KJT's place: a forward that reads
    the KJT's own attributes is told so in one UserError line (out of Dynamo's trace too), not an
    AttributeError deep in a compiled frame."""
    from tpurec.errors import UserError
    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.pipelined import PipelinedStep

    monkeypatch.setattr(__import__(__name__, fromlist=["TwoEBCs"]), "TwoEBCs", _ReadsTheKJT)
    dmp = _dmp("shared")
    assert isinstance(dmp.module, _ReadsTheKJT)
    step: Any = CompiledStep(dmp, DENSE_LR) if kind == "compiled" else PipelinedStep(dmp, DENSE_LR)
    batches = _batches("shared")
    with pytest.raises(UserError, match=r"the model's forward reads `\.keys` of it, which needs the KJT itself"):
        for b in batches[:3]:
            step.step(b)
