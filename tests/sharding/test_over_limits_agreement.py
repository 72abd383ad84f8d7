"""The ranks agree on a batch over its fixed id limits: every rank steps it eagerly, or none does.

A rank sees only its own shards' SparseCore inputs, so with table-wise sharding one rank's batch can
be over its limits while the other's is not. On a TPU each rank then running a different program
(one the compiled step, the other the eager ops) is what TorchTPU's compile-time handshake of
collective programs cannot pair up (docs/tpu.md); here, over gloo, the collectives would pair up all
the same, so what is asserted is the agreement itself: both ranks count the same eager steps, and
every loss and table is the eager DMP step's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dlrm_step import DENSE_LR, OVER_STEPS, dlrm_dmp, over_stream, table_shards

from .dlrm_case import FEATURES, eager_step
from .multiprocess import run_ranks


def compiled_over(rank: int, world_size: int, types: dict[str, str]) -> dict[str, Any]:
    """The over-limit stream (batches 3 and 7 over on the rank holding table t0) through TorchRec's
    eager DMP step and tpurec's CompiledStep."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.sharding.step.inputs import over_limits, parts

    torch._dynamo.reset()
    eager, twin = dlrm_dmp(world_size, types), dlrm_dmp(world_size, types)
    sgd = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(eager.named_parameters())], lr=DENSE_LR)
    eager_losses = [eager_step(eager, sgd, b) for b in over_stream(OVER_STEPS, rank, world_size)]
    counter = CompileCounterWithBackend("aot_eager")
    step = CompiledStep(twin, DENSE_LR, backend=counter)
    over_here, losses = [], []
    for t, batch in enumerate(over_stream(OVER_STEPS, rank, world_size)):
        if any(over_limits(p) for p in parts(step.preprocess(batch))):  # this rank's own shards
            over_here.append(t)
        losses.append(float(step.step(batch)))
    after, twin_after = table_shards(eager), table_shards(twin)
    return {
        "over_here": over_here,
        "eager": eager_losses,
        "compiled": losses,
        "eager_steps": step.eager_steps,
        "frames": counter.frame_count,
        "tables_equal": all(torch.equal(after[k], twin_after[k]) for k in after),
    }


@pytest.mark.slow
def test_compiled_step_ranks_agree_on_a_batch_over_the_limits():
    types = {f"t{i}": "table_wise" for i in range(FEATURES)}
    results = run_ranks(compiled_over, 2, types, timeout=600)
    # the premise: only the rank holding t0 is over its limits, at batches 3 and 7
    assert sorted(r["over_here"] for r in results) == [[], [3, OVER_STEPS - 1]]
    for rank, result in enumerate(results):
        assert result["eager_steps"] == 2, rank  # both ranks stepped both batches eagerly
        assert result["frames"] == 1, rank  # the other six in the one graph
        assert result["compiled"] == result["eager"], rank
        assert result["tables_equal"], rank


def test_any_ranks_batch_over_its_limits_sends_every_rank_to_the_eager_step(monkeypatch):
    """`any_rank_over_limits` on one rank of 3, the all-reduce faked with the other ranks' flags."""
    import torch.distributed as dist

    from tpurec.sharding.step import inputs as step_inputs

    others: list[int] = []
    monkeypatch.setattr(step_inputs, "over_limits", lambda part: ["t0"] if part == "over" else [])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")

    def all_reduce(flag, group, op=dist.ReduceOp.SUM):
        assert group == "g" and flag.device.type == "cpu"
        values = [int(flag[0]), *others]
        flag[0] = sum(values) if op == dist.ReduceOp.SUM else max(values) if op == dist.ReduceOp.MAX else min(values)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    cases = [
        (["ok"], [0, 0], False),
        (["ok", "ok"], [0, 1], True),
        (["ok", "over"], [0, 0], True),
        (["over"], [1, 1], True),
    ]
    for parts, others[:], want in cases:
        assert step_inputs.any_rank_over_limits(parts, "g", 3, None) is want, (parts, others)
    # one rank, or no group: its own batch decides, no collective
    others[:] = [1, 1]
    assert step_inputs.any_rank_over_limits(["ok"], "g", 1, None) is False
    assert step_inputs.any_rank_over_limits(["over"], None, 3, None) is True
