"""A tpurec-DMP training step compiled with torch.compile(fullgraph=True): one graph, no graph break,
and the eager step's losses and tables (tpurec/sharding/step/compiled.py, docs/kernels.md "Compiled step").

The oracle is TorchRec's own eager step of an identical DMP (built from the same seed) on the same
batches: DMP's forward (input dist, lookups, output dist through TorchRec's awaitables), DDP's
gradient average and torch.optim.SGD. The compiled step runs the same kernels in the same order on
the same numbers, so with the aot_eager backend (no reordering of float sums) every loss and table
is bit-equal, and the tests assert exact equality (inductor, which reorders float32 sums: within 1e-6).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.helpers.dlrm_step import BATCH, DENSE_LR, MIXED, dlrm_dmp, table_shards, trainer_optimizer

from .dlrm_case import FEATURES, batches, eager_step
from .multiprocess import run_ranks

STEPS = 20


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles its own graph
    yield
    torch._dynamo.reset()


def _dlrm_tiny(world_size: int, sharding_types: dict[str, str] | None, pooling: str = "SUM") -> Any:
    """tpurec's dlrm-tiny (26 tables, Kaggle sizes capped at 1000 rows, dim 16; its DLRMTrain and
    table optimizer) sharded by tpurec's DMP with fixed id limits."""
    import tpurec
    from tpurec.dlrm.configs import get_config
    from tpurec.dlrm.model import build_model
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    assert world_size == 1 and sharding_types is None and pooling == "SUM"
    torch.manual_seed(0)
    model = build_model(get_config("dlrm-tiny"))
    return tpurec.DistributedModelParallel(
        model, device="cpu", batch_size=BATCH, sharders=[SparseCoreEBCSharder(max_ids_per_partition=64)]
    )


def _dlrm_tiny_batches(n: int, batch: int, rank: int, world_size: int) -> list:
    """One id per feature and sample, uniform over each dlrm-tiny table's rows; labels at random."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.data.catalog import DLRM_TINY_ROWS, FEATURE_NAMES, NUM_DENSE

    assert world_size == 1 and rank == 0
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor(DLRM_TINY_ROWS)
    out = []
    for _ in range(n):
        ids = (torch.rand(len(rows), batch, generator=gen) * rows[:, None]).long()
        kjt = KeyedJaggedTensor(
            keys=FEATURE_NAMES, values=ids.reshape(-1), lengths=torch.ones(len(rows) * batch, dtype=torch.long)
        )
        dense = torch.randn(batch, NUM_DENSE, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


class _Recorder(CompileCounterWithBackend):
    """Counts the compiled frames and keeps each graph's code."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.codes: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # the top graph's code and its subgraphs' (an autograd.Function's forward and backward bodies)
        self.codes += [m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        return super().__call__(gm, example_inputs)


_COLLECTIVE = r"(\w*(?:all_to_all|reduce_scatter|all_reduce|all_gather)\w*)"


def train_pair(
    rank: int,
    world_size: int,
    sharding_types: dict[str, str] | None = None,
    model: str = "dlrm_case",
    backend: str = "aot_eager",
    pooling: str = "SUM",
) -> dict:
    """STEPS steps of the eager and of the compiled step on twin DMPs; the figures to compare."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.sharding.step.compiled import CompiledStep

    build, data = (dlrm_dmp, batches) if model == "dlrm_case" else (_dlrm_tiny, _dlrm_tiny_batches)
    eager, twin = build(world_size, sharding_types, pooling), build(world_size, sharding_types, pooling)
    initial = table_shards(eager)
    same_start = all(torch.equal(initial[k], v) for k, v in table_shards(twin).items())
    dense = [p for _, p in in_backward_optimizer_filter(eager.named_parameters())]
    sgd = torch.optim.SGD(dense, lr=DENSE_LR)
    counter = _Recorder(backend)
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    eager_losses, compiled_losses = [], []
    for batch in data(STEPS, BATCH, rank, world_size):
        eager_losses.append(eager_step(eager, sgd, batch))
        compiled_losses.append(float(step.step(batch)))
    after, twin_after = table_shards(eager), table_shards(twin)
    twin_dense = [p for _, p in in_backward_optimizer_filter(twin.named_parameters())]
    return {
        "same_start": same_start,
        "eager": eager_losses,
        "compiled": compiled_losses,
        "frames": counter.frame_count,
        "table_diff": max(float((after[k] - twin_after[k]).abs().max()) for k in after),
        "tables_moved": min(float((after[k] - initial[k]).abs().max()) for k in after) if after else None,
        "dense_diff": max(float((p - q).abs().max()) for p, q in zip(dense, twin_dense, strict=True)),
        "collectives": sorted({name for code in counter.codes for name in re.findall(_COLLECTIVE, code)}),
        # the top graph's all-reduces: the dense gradients' one bucket (dense_update.py)
        "all_reduces": len(re.findall(r"\ball_reduce\b", counter.codes[0])),
        "plan": sorted({ps.sharding_type for mp in twin.plan.plan.values() for ps in mp.values()}),
    }


def _assert_same_training(result: dict, tol: float = 0.0) -> None:
    assert result["same_start"]
    assert result["frames"] == 1  # one graph for all STEPS batches: no graph break, no recompile
    assert result["compiled"] == pytest.approx(result["eager"], abs=tol, rel=0)
    assert result["table_diff"] <= tol and result["dense_diff"] <= tol
    # the fused updates ran in the graph: every table shard moved (a lost update would leave both at the start)
    assert result["tables_moved"] > 1e-3


def test_compiled_dmp_step_is_one_graph_without_breaks():
    from tpurec.sharding.step.compiled import CompiledStep

    step = CompiledStep(dlrm_dmp(1, None), DENSE_LR)
    explained = step.explain(batches(1, BATCH, 0, 1)[0])
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    stacks = sum(len(k.kernel.stacks) for lookup in step.sharded._lookups for k in lookup._emb_modules)
    assert stacks >= 1 and code.count("torch.ops.tpurec.fused_lookup") == stacks


def test_compiled_dmp_step_equals_eager_one_rank():
    result = train_pair(0, 1)
    assert result["plan"] == ["table_wise"]
    _assert_same_training(result)


OUTPUT_DIST = {
    "table_wise": ["all_to_all_single"],
    "row_wise": ["all_to_all_single"],
    "column_wise": ["all_to_all_single"],
    "table_row_wise": ["reduce_scatter_tensor"],
    "table_column_wise": ["all_to_all_single"],
    "mixed": ["all_to_all_single", "reduce_scatter_tensor"],
    "row_wise_mean": ["all_to_all_single"],
}


def test_compiled_step_refuses_what_it_cannot_split():
    from dataclasses import replace
    from types import SimpleNamespace

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.errors import UserError
    from tpurec.sharding.step.compiled import CompiledStep

    # no sharded EBC for batch.sparse_features to go to
    with pytest.raises(UserError, match="a sharded EmbeddingBagCollection.*has none"):
        CompiledStep(SimpleNamespace(module=torch.nn.Linear(2, 2)), DENSE_LR)
    # a batch per feature (VBE): refused before any collective, in one line
    step = CompiledStep(dlrm_dmp(1, None), DENSE_LR)
    vbe = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(FEATURES)],
        values=torch.arange(2 * FEATURES),
        lengths=torch.ones(2 * FEATURES, dtype=torch.long),
        stride_per_key_per_rank=[[1], [2], [3], [2]],
        inverse_indices=([f"f{i}" for i in range(FEATURES)], torch.zeros(FEATURES, 3, dtype=torch.int)),
    )
    batch = replace(batches(1, 3, 0, 1)[0], sparse_features=vbe)
    with pytest.raises(UserError, match="VBE"):
        step.step(batch)


def test_compiled_dmp_step_equals_eager_dlrm_tiny():
    result = train_pair(0, 1, model="dlrm_tiny")
    assert result["plan"] == ["table_wise"]
    _assert_same_training(result)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_dmp_step_inductor(world_size):
    # inductor fuses the dense model's kernels and reorders their float32 sums: the eager numbers
    # within 1e-6 over 20 steps, not bit for bit (aot_eager runs the eager kernels: exact); at two
    # ranks the mixed model (four sharding types)
    if world_size == 1:
        results = [train_pair(0, 1, backend="inductor")]
    else:
        results = run_ranks(train_pair, 2, MIXED, "dlrm_case", "inductor", "SUM", timeout=900)
    for result in results:
        _assert_same_training(result, tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("sharding_type", list(OUTPUT_DIST))
def test_compiled_dmp_step_equals_eager_two_ranks(sharding_type):
    # two gloo ranks: the output dist's all-to-all / reduce-scatter and the dense gradients' all-reduce
    # as functional collectives inside the graph; "mixed": four sharding types, four lookups and dists;
    # "row_wise_mean": mean pooling, the pooled sums divided in the graph by the host's id counts
    pooling = "MEAN" if sharding_type == "row_wise_mean" else "SUM"
    kind = sharding_type.removesuffix("_mean")
    types = MIXED if kind == "mixed" else {f"t{i}": kind for i in range(FEATURES)}
    for rank, result in enumerate(run_ranks(train_pair, 2, types, "dlrm_case", "aot_eager", pooling, timeout=600)):
        assert result["plan"] == sorted(set(types.values())), rank
        _assert_same_training(result)
        # in the graph (Dynamo traces TorchRec's comm ops as functional collectives): the dense
        # gradients' all-reduce, and the pooled embeddings' output dist: an all-to-all (RW's
        # reduce-scatter-v too, comm_ops.py), TWRW's intra-host reduce-scatter (one host: no cross all-to-all)
        assert result["collectives"] == ["all_reduce", *OUTPUT_DIST[sharding_type]], rank
        assert result["all_reduces"] == 1, rank  # the 8 dense gradients in one bucket


@pytest.mark.parametrize("kind", ["adagrad", "adam", "sgd"])
def test_compiled_step_trains_with_the_trainers_optimizer_and_lr_schedule(kind):
    """The trainer's dense optimizer (adagrad: the built-in configs' default) and its lr schedule in
    the compiled step: 20 steps bit-equal to the eager step (TorchRec's DMP, torch.optim's step,
    the fused table update reading the scheduled lr), one graph: the changing lrs compile nothing new."""
    from tpurec.sharding.step.compiled import CompiledStep

    eager, twin = dlrm_dmp(1, None), dlrm_dmp(1, None)
    eager_opt, eager_schedule = trainer_optimizer(eager, kind)
    twin_opt, twin_schedule = trainer_optimizer(twin, kind)
    counter = CompileCounterWithBackend("aot_eager")
    step = CompiledStep(twin, twin_opt, backend=counter)
    initial = table_shards(eager)
    eager_losses, compiled_losses = [], []
    for i, batch in enumerate(batches(STEPS, BATCH, 0, 1)):
        eager_schedule.set_step(i)
        eager_losses.append(eager_step(eager, eager_opt, batch))
        twin_schedule.set_step(i)
        compiled_losses.append(float(step.step(batch)))
    assert counter.frame_count == 1
    assert compiled_losses == eager_losses
    after, twin_after = table_shards(eager), table_shards(twin)
    assert all(torch.equal(after[k], twin_after[k]) for k in after)
    assert min(float((after[k] - initial[k]).abs().max()) for k in after) > 1e-3
    # the dense state is the optimizer's own, as the eager step left its twin's (what a checkpoint saves)
    eager_state, twin_state = eager_opt.state_dict()["state"], twin_opt.state_dict()["state"]
    assert eager_state.keys() == twin_state.keys()
    dense = [key for key in eager_state if "embedding_bags" not in key]  # the tables: compared above
    # the dense MLPs' 8 weights and biases: adagrad's step and sum, adam's step and moments; sgd keeps none
    assert len(dense) == (0 if kind == "sgd" else 8)
    assert all(len(eager_state[key]) == {"adagrad": 2, "adam": 3}[kind] for key in dense)
    for key in dense:
        for name, tensor in eager_state[key].items():
            assert torch.equal(tensor, twin_state[key][name]), (key, name)


def test_a_batch_over_the_fixed_limits_steps_eagerly_and_the_graph_stays_one():
    """A batch over its fixed id limits (several passes: no fixed graph) runs its step eagerly, with
    the eager DMP step's numbers; the batches around it stay in the one compiled graph."""
    from dataclasses import replace

    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.sharding.step.compiled import CompiledStep

    eager, twin = dlrm_dmp(1, None), dlrm_dmp(1, None)
    data = batches(4, BATCH, 0, 1, seed=2)
    # batch 1: 20 ids per bag of f0, rows 0, 4, .., 76 (one partition of four, MOD sharding): each
    # SparseCore's 8 samples put 160 ids there, over the limit of 64
    keys = [f"f{i}" for i in range(FEATURES)]
    lengths = torch.ones(FEATURES * BATCH, dtype=torch.long)
    lengths[:BATCH] = 20
    values = torch.cat([(torch.arange(20 * BATCH) % 20) * 4, data[1].sparse_features.values()[BATCH:]])
    data[1] = replace(data[1], sparse_features=KeyedJaggedTensor(keys=keys, values=values, lengths=lengths))
    sgd = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(eager.named_parameters())], lr=DENSE_LR)
    counter = _Recorder("aot_eager")
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    kernels = [k.kernel for lookup in step.sharded._lookups for k in lookup._emb_modules]
    for i, batch in enumerate(data):
        assert float(step.step(batch)) == eager_step(eager, sgd, batch), i
        assert step.eager_steps == (0 if i == 0 else 1)
    assert counter.frame_count == 1  # compiled for batch 0, reused by batches 2 and 3
    assert sum(k.multipass_batches for k in kernels) >= 1
    after, twin_after = table_shards(eager), table_shards(twin)
    assert all(torch.equal(after[k], twin_after[k]) for k in after)


def test_step_ahead_preprocesses_the_next_batch_after_queuing_this_one_and_trains_as_step():
    """`step_ahead` (what `tpurec train --step compiled` runs): batch i+1's host half after step i is
    queued (so it runs while the device runs step i), the same losses and tables as `step` on a twin,
    bit for bit; a batch preprocessed ahead is preprocessed again after `forget_ahead` (an
    evaluation between); StopIteration once the batches are done."""
    from tpurec.sharding.step.compiled import CompiledStep

    data = batches(6, BATCH, 0, 1)
    plain, ahead = CompiledStep(dlrm_dmp(1, None), DENSE_LR), CompiledStep(dlrm_dmp(1, None), DENSE_LR)
    events: list[str] = []
    index = {id(b): i for i, b in enumerate(data)}
    preprocess, run = ahead.preprocess, ahead.run_prepared

    def logged_preprocess(batch):
        events.append(f"pre {index[id(batch)]}")
        return preprocess(batch)

    def logged_run(prepared):
        events.append("run")
        return run(prepared)

    ahead.preprocess, ahead.run_prepared = logged_preprocess, logged_run
    it = iter(data)
    got = []
    for i in range(len(data)):
        if i == 3:
            ahead.forget_ahead()
        got.append(float(ahead.step_ahead(it)))
    with pytest.raises(StopIteration):
        ahead.step_ahead(it)
    want = [float(plain.step(b)) for b in data]
    assert got == want
    assert events == ["pre 0", "run", "pre 1", "run", "pre 2", "run", "pre 3"] + [
        "pre 3",
        "run",
        "pre 4",
        "run",
        "pre 5",
        "run",
    ]
    a, b = table_shards(plain.module), table_shards(ahead.module)
    assert all(torch.equal(a[k], b[k]) for k in a)
