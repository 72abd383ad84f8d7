"""CompiledStep on a model holding a sharded EmbeddingCollection (tpurec/sharding/ec_preprocess.py),
alone and beside a sharded EmbeddingBagCollection, one CPU rank, aot_eager.

The model sums each sample's sequence embeddings with a mask built from the JaggedTensor's offsets (a
segment sum of fixed shape: it reads every row of `values()`, padding included), then a linear layer and
BCE. Oracles: TorchRec's eager step of a twin DMP (same seed, same batches: DMP's forward, backward with
the fused updates, torch.optim.SGD) on the EC's fixed-shape path, the same arithmetic, so every loss,
table and dense weight is bit-equal; and the eager step on TorchRec's own sequence output dist (values of
exactly the batch's ids, no padding), equal within 1e-6: the padding rows are zeros and add nothing, but
the segment sum's matmul runs over more rows, which may change its float32 summation order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.helpers.sequence_model import (
    BATCH,
    CAPACITY,
    ROWS,
    SeqBatch,
    SeqModel,
    sequence_batches,
    sequence_dmp,
)

STEPS, DENSE_LR = 12, 0.1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tables(dmp: Any) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in dmp.state_dict().items():
        if ("embeddings." in key or "embedding_bags." in key) and value.local_shards():
            out[key] = torch.cat([s.tensor.flatten() for s in value.local_shards()]).clone()
    return out


def _dense(dmp: Any) -> list[torch.Tensor]:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]


def _eager(dmp: Any, data: list[SeqBatch]) -> list[float]:
    from .dlrm_case import eager_step

    sgd = torch.optim.SGD(_dense(dmp), lr=DENSE_LR)
    return [eager_step(dmp, sgd, b) for b in data]


@pytest.mark.parametrize("ebc", [False, True], ids=["ec", "ec_and_ebc"])
def test_compiled_step_of_an_ec_model_is_one_graph_and_equals_the_eager_step(ebc):
    from tpurec.sharding.step.compiled import CompiledStep

    data = sequence_batches(STEPS)
    assert len({int(b.seq_features.values().numel()) for b in data}) > 3  # id counts differ batch to batch
    eager, torchrec_path, twin = sequence_dmp(ebc), sequence_dmp(ebc, fixed=False), sequence_dmp(ebc)
    initial = _tables(twin)
    eager_losses, torchrec_losses = _eager(eager, data), _eager(torchrec_path, data)
    counter = CompileCounterWithBackend("aot_eager")
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    losses = [float(step.step(b)) for b in data]
    assert counter.frame_count == 1 and step.eager_steps == 0  # one graph for every batch
    assert len(step.fields.modules) == (2 if ebc else 1)
    # bit-equal to the eager step on the fixed path: losses, every table, dense weights
    assert losses == eager_losses
    got, want = _tables(twin), _tables(eager)
    assert sorted(got) == sorted(want) and len(got) == (4 if ebc else 2)
    for key in got:
        assert torch.equal(got[key], want[key]), key
        assert float((got[key] - initial[key]).abs().max()) > 1e-3, key  # every table was updated
    for p, q in zip(_dense(twin), _dense(eager), strict=True):
        assert torch.equal(p, q)
    # and to TorchRec's unpadded output path within 1e-6 (see the module docstring)
    assert max(abs(a - b) for a, b in zip(losses, torchrec_losses)) < 1e-6
    ref = _tables(torchrec_path)
    assert max(float((got[k] - ref[k]).abs().max()) for k in got) < 1e-6


@pytest.mark.slow  # inductor's compile: 15 s
def test_compiled_ec_step_with_inductor_is_one_graph_within_1e6():
    """Inductor reorders float32 sums: one frame, and losses, tables and dense weights within 1e-6."""
    from tpurec.sharding.step.compiled import CompiledStep

    data = sequence_batches(STEPS)
    eager, twin = sequence_dmp(True), sequence_dmp(True)
    eager_losses = _eager(eager, data)
    counter = CompileCounterWithBackend("inductor")
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    losses = [float(step.step(b)) for b in data]
    assert counter.frame_count == 1
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < 1e-6
    got, want = _tables(twin), _tables(eager)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-6
    assert max(float((p - q).detach().abs().max()) for p, q in zip(_dense(twin), _dense(eager))) < 1e-6


def test_explain_shows_one_graph_without_breaks():
    from tpurec.sharding.step.compiled import CompiledStep

    step = CompiledStep(sequence_dmp(True), DENSE_LR)
    out = step.explain(sequence_batches(1)[0])
    assert out.graph_count == 1 and out.graph_break_count == 0, out.break_reasons
    code = "".join(g.code for g in out.graphs)
    # one lookup per stack: the EC's two tables in one stack, the EBC's in another
    assert code.count("tpurec.fused_lookup") == 2, code.count("tpurec.fused_lookup")


@pytest.mark.parametrize("kind", ["compiled", "pipelined"])
def test_a_batch_over_the_capacity_steps_eagerly_and_the_next_ones_stay_in_the_graph(kind):
    """A batch with a sequence over `max_ids_per_feature` (lookup blocks, two all-to-all rounds, longer
    values) has no fixed graph: it is stepped eagerly, the same arithmetic (the pipelined step drains the
    batches in flight first); the others in one graph. Disjoint batches, for the pipelined step's sake."""
    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.pipelined import PipelinedStep

    def data() -> list[SeqBatch]:
        out = sequence_batches(8)
        out[4] = sequence_batches(1, longest=12, seed=3)[0]  # 33 and 45 ids in its features: over 32
        return disjoint(out)

    assert max(data()[4].seq_features.length_per_key()) > CAPACITY
    eager, twin = sequence_dmp(False), sequence_dmp(False)
    eager_losses = _eager(eager, data())
    counter = CompileCounterWithBackend("aot_eager")
    if kind == "compiled":
        step = CompiledStep(twin, DENSE_LR, backend=counter)
        losses = [float(step.step(b)) for b in data()]
        assert step.eager_steps == 1
    else:
        pipe = PipelinedStep(twin, DENSE_LR, backend=counter)
        losses = [float(x) for x in pipe.iterate(data())]
        assert pipe.eager_steps == 1 and pipe.updated_batches == 8
    assert counter.frame_count == 1
    assert losses == eager_losses
    got, want = _tables(twin), _tables(eager)
    assert all(torch.equal(got[k], want[k]) for k in got)


def disjoint(data: list[SeqBatch]) -> list[SeqBatch]:
    """Each id folded into the lower half of its table's rows on even steps and the upper half on odd ones:
    consecutive batches share no row, so the pipelined step's lookups read no stale row."""
    for t, b in enumerate(data):
        for kjt in (b.seq_features, b.sparse_features):
            ids = kjt.values()
            ids.copy_(ids % (ROWS // 2) + (ROWS // 2) * (t % 2))
    return data


@pytest.mark.parametrize("ebc", [False, True], ids=["ec", "ec_and_ebc"])
def test_pipelined_step_of_an_ec_model_equals_the_eager_step_on_disjoint_batches(ebc):
    """PipelinedStep (SparseCore forward of t+2, the model on t+1, SparseCore backward of t; its steady
    step compiled): on batches whose consecutive ones share no row, every loss, table and dense weight
    bit-equal to the eager step's; one compiled frame for the steady steps."""
    from tpurec.sharding.step.pipelined import PipelinedStep

    eager, twin = sequence_dmp(ebc), sequence_dmp(ebc)
    initial = _tables(twin)
    eager_losses = _eager(eager, disjoint(sequence_batches(STEPS)))
    counter = CompileCounterWithBackend("aot_eager")
    pipe = PipelinedStep(twin, DENSE_LR, backend=counter)
    losses = [float(x) for x in pipe.iterate(disjoint(sequence_batches(STEPS)))]
    assert counter.frame_count == 1 and pipe.eager_steps == 0 and pipe.updated_batches == STEPS
    assert losses == eager_losses
    got, want = _tables(twin), _tables(eager)
    for key in got:
        assert torch.equal(got[key], want[key]), key
        assert float((got[key] - initial[key]).abs().max()) > 1e-3, key
    for p, q in zip(_dense(twin), _dense(eager), strict=True):
        assert torch.equal(p, q)


def _train_rank(rank: int, world_size: int, types: dict[str, str], kind: str) -> dict:
    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.pipelined import PipelinedStep

    def data() -> list[SeqBatch]:
        return disjoint(sequence_batches(STEPS, seed=rank))

    eager, twin = sequence_dmp(True, types=types), sequence_dmp(True, types=types)
    eager_losses = _eager(eager, data())
    counter = CompileCounterWithBackend("aot_eager")
    if kind == "compiled":
        step = CompiledStep(twin, DENSE_LR, backend=counter)
        losses = [float(step.step(b)) for b in data()]
        eager_steps = step.eager_steps
    else:
        pipe = PipelinedStep(twin, DENSE_LR, backend=counter)
        losses = [float(x) for x in pipe.iterate(data())]
        eager_steps = pipe.eager_steps
    got, want = _tables(twin), _tables(eager)
    return {
        "frames": counter.frame_count,
        "eager_steps": eager_steps,
        "losses": losses,
        "eager": eager_losses,
        "tables": sorted(got),
        "table_diff": max(float((got[k] - want[k]).abs().max()) for k in got),
        "dense_diff": max(float((p - q).detach().abs().max()) for p, q in zip(_dense(twin), _dense(eager))),
        "plan": {t: ps.sharding_type for mp in twin.plan.plan.values() for t, ps in mp.items()},
    }


TW_RW = {"e0": "table_wise", "e1": "row_wise", "t0": "column_wise", "t1": "row_wise"}
CW_TW = {"e0": "column_wise", "e1": "table_wise", "t0": "table_wise", "t1": "table_row_wise"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kind, types", [("compiled", TW_RW), ("compiled", CW_TW), ("pipelined", TW_RW)], ids=["tw_rw", "cw_tw", "piped"]
)
def test_ec_steps_on_two_ranks_equal_the_eager_step(kind, types):
    """Two gloo ranks (about 17 s each), the EC's tables table-wise (a rank holding none of them sends rows
    that carry no gradient, yet takes part in the backward all-to-all), row-wise or column-wise beside the
    EBC's: the output dists' functional all-to-alls in the one graph (disjoint batches, for the pipelined
    step's sake)."""
    from .multiprocess import run_ranks

    results = run_ranks(_train_rank, 2, types, kind, timeout=600)
    for rank, r in enumerate(results):
        assert r["plan"] == types, rank
        assert r["frames"] == 1 and r["eager_steps"] == 0, rank
        assert r["losses"] == r["eager"], rank
        assert r["table_diff"] == 0.0 and r["dense_diff"] == 0.0, rank
    assert len({t for r in results for t in r["tables"]}) == 4  # every table compared on some rank


def test_dmp_fixed_limits_puts_the_default_sharders_ec_on_its_fixed_path():
    """DistributedModelParallel(fixed_limits=True) (what `tpurec train --step compiled` sets for a model
    with an EC): the EC's outputs on the fixed-shape path and every kernel's limits fixed, on CPU; the
    default leaves both as TorchRec's; with the user's own sharders the keyword is refused."""
    import tpurec
    from tpurec.errors import UserError

    def shard(**kwargs: Any) -> Any:
        torch.manual_seed(0)
        return tpurec.DistributedModelParallel(SeqModel(ebc=True), device="cpu", batch_size=BATCH, **kwargs)

    from tpurec.dlrm.id_feedback import every_kernel as kernels
    from tpurec.sharding.ec_sharder import SparseCoreECSharder

    fixed, default = shard(fixed_limits=True), shard()
    assert fixed.module.ec._fixed_output is not None and default.module.ec._fixed_output is None
    assert len(kernels(fixed)) == 2 and all(k.fixed_limits for k in kernels(fixed))  # the EC's and the EBC's
    assert len(kernels(default)) == 2 and not any(k.fixed_limits for k in kernels(default))

    with pytest.raises(UserError, match=r"fixed_limits= sets the default sharders' limits"):
        shard(fixed_limits=True, sharders=[SparseCoreECSharder()])
