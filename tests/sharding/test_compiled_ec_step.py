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

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

STEPS, BATCH, DIM, ROWS, DENSE = 12, 8, 8, 40, 3
DENSE_LR, TABLE_LR = 0.1, 0.1
CAPACITY = 32  # max_ids_per_feature: a batch's sequences hold at most BATCH x 3 = 24 ids per feature


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@dataclass
class SeqBatch:
    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor  # f0, f1: one id per sample (the EBC's)
    seq_features: KeyedJaggedTensor  # s0, s1: 0-3 ids per sample (the EC's)
    labels: torch.Tensor


def sequence_sum(jt: JaggedTensor) -> torch.Tensor:
    """[batch, dim]: each sample's embeddings summed, as a [batch, rows] 0/1 mask from the offsets times
    `values()` (fixed shapes: rows is the values' padded length in the compiled step), built where the
    offsets are: beside the values, on the device (as a model written for TorchRec on a GPU builds it)."""
    values, offsets = jt.values(), jt.offsets()
    row = torch.arange(values.shape[0], device=offsets.device)
    mask = (row >= offsets[:-1, None]) & (row < offsets[1:, None])
    return mask.to(values.dtype) @ values


class SeqModel(nn.Module):
    """An EC of tables e0, e1 (features s0, s1) and, with `ebc`, an EBC of t0, t1 (f0, f1); a linear
    layer over the summed sequences, the pooled embeddings and the dense features; (loss, logits)."""

    def __init__(self, ebc: bool, pool: str = "mask") -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

        super().__init__()
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(name=f"e{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"s{i}"])
                for i in range(2)
            ],
            device=torch.device("meta"),
        )
        self.ebc = (
            EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                    for i in range(2)
                ],
                device=torch.device("meta"),
            )
            if ebc
            else None
        )
        self.over = nn.Linear((4 if ebc else 2) * DIM + DENSE, 1)
        self.pool = pool

    def pooled(self, jt: JaggedTensor, batch: int) -> torch.Tensor:
        if self.pool == "mask":
            return sequence_sum(jt)
        # "total": every id's embedding summed, the same for each sample (padding rows add zeros): reads
        # neither lengths nor offsets
        return jt.values().sum(0, keepdim=True).expand(batch, -1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = self.ec(batch.seq_features)
        n = batch.labels.shape[0]
        x = [self.pooled(seqs["s0"], n), self.pooled(seqs["s1"], n), batch.dense_features]
        if self.ebc is not None:
            x.append(self.ebc(batch.sparse_features).values())
        logits = self.over(torch.cat(x, dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def batches(n: int, longest: int = 3, seed: int = 0) -> list[SeqBatch]:
    """Sequences of 0..longest ids (empty ones too, repeated ids), a label that depends on the ids."""
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(ROWS, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(n):
        lengths = torch.randint(0, longest + 1, (2 * BATCH,), generator=gen)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        seq = KeyedJaggedTensor(keys=["s0", "s1"], values=ids, lengths=lengths)
        per_sample = torch.zeros(BATCH).index_add_(
            0, torch.repeat_interleave(torch.arange(2 * BATCH) % BATCH, lengths), score[ids]
        )
        sparse = KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.randint(0, ROWS, (2 * BATCH,), generator=gen),
            lengths=torch.ones(2 * BATCH, dtype=torch.long),
        )
        dense = torch.randn(BATCH, DENSE, generator=gen)
        out.append(SeqBatch(dense, sparse, seq, (per_sample > 0).float()))
    return out


def _dmp(
    ebc: bool, fixed: bool = True, types: dict[str, str] | None = None, device: str = "cpu", pool: str = "mask"
) -> Any:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.sharding.ec_sharder import SparseCoreECSharder
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    torch.manual_seed(0)
    model = SeqModel(ebc, pool)
    tables = [p for m in (model.ec, model.ebc) if m is not None for p in m.parameters()]
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": TABLE_LR})
    sharders: list[Any] = [
        SparseCoreECSharder(fixed_limits=True, max_ids_per_feature=CAPACITY, max_ids_per_partition=64)
    ]
    if ebc:
        sharders.append(SparseCoreEBCSharder(max_ids_per_partition=64))
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in (types or {}).items()} or None
    dmp = tpurec.DistributedModelParallel(
        model, device=device, batch_size=BATCH, sharders=sharders, constraints=constraints
    )
    if not fixed:  # the same kernels, TorchRec's own sequence output dist (values unpadded)
        dmp.module.ec._fixed_output = None
    return dmp


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

    data = batches(STEPS)
    assert len({int(b.seq_features.values().numel()) for b in data}) > 3  # id counts differ batch to batch
    eager, torchrec_path, twin = _dmp(ebc), _dmp(ebc, fixed=False), _dmp(ebc)
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

    data = batches(STEPS)
    eager, twin = _dmp(True), _dmp(True)
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

    step = CompiledStep(_dmp(True), DENSE_LR)
    out = step.explain(batches(1)[0])
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
        out = batches(8)
        out[4] = batches(1, longest=12, seed=3)[0]  # 33 and 45 ids in its features: over 32
        return disjoint(out)

    assert max(data()[4].seq_features.length_per_key()) > CAPACITY
    eager, twin = _dmp(False), _dmp(False)
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

    eager, twin = _dmp(ebc), _dmp(ebc)
    initial = _tables(twin)
    eager_losses = _eager(eager, disjoint(batches(STEPS)))
    counter = CompileCounterWithBackend("aot_eager")
    pipe = PipelinedStep(twin, DENSE_LR, backend=counter)
    losses = [float(x) for x in pipe.iterate(disjoint(batches(STEPS)))]
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
        return disjoint(batches(STEPS, seed=rank))

    eager, twin = _dmp(True, types=types), _dmp(True, types=types)
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
