"""The ranks' fixed id limits made equal (tpurec/sharding/rank_limits.py), on two gloo ranks.

Table-wise, each rank holds its own tables, whose measured limits differ; after `align_fixed_limits`
every rank's stack has the largest limits any rank had for it, and a step still trains as before.
Where the ranks' kernels differ in their stacks (other table dims on one rank), nothing is changed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sharding.multiprocess import run_ranks

# rank 0 holds t0 and t1 (table-wise), rank 1 holds t2 and t3; the measured limits differ per table
LIMITS = {"t0": (40, 24), "t1": (16, 8), "t2": (24, 16), "t3": (8, 8)}
PLACE = {"t0": 0, "t1": 0, "t2": 1, "t3": 1}


def _limits_on_rank(rank: int, world: int, dims: dict[str, int]) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import tpurec
    from tpurec.sharding.rank_limits import _kernels, align_fixed_limits

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=dims[t], num_embeddings=64, feature_names=[f"f{t[1:]}"])
        for t in LIMITS
    ]
    ebc = EmbeddingBagCollection(tables)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {t: table_wise(rank=r) for t, r in PLACE.items()})})
    dmp = tpurec.DistributedModelParallel(ebc, device="cpu", plan=plan, id_limits=LIMITS, fixed_limits=True)
    kjt = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(4)], values=torch.arange(32) % 64, lengths=torch.ones(32, dtype=torch.long)
    )
    before = [k.inputs.stack_limits(i) for _, k in _kernels(dmp) for i in range(len(k.inputs.stacks))]
    first = dmp(kjt).wait().values()
    raised = align_fixed_limits(dmp, dist.group.WORLD)
    after = [k.inputs.stack_limits(i) for _, k in _kernels(dmp) for i in range(len(k.inputs.stacks))]
    same = torch.equal(dmp(kjt).wait().values(), first)  # larger buffers, the same lookup
    return {"before": before, "after": after, "raised": raised, "same": same}


def _every_case(rank: int, world: int) -> dict[str, Any]:
    """Every case below on the same two ranks (one spawn: each costs seconds of imports)."""
    import os

    out = {
        "same_stacks": _limits_on_rank(rank, world, {t: 8 for t in LIMITS}),
        "other_stacks": _limits_on_rank(rank, world, {"t0": 8, "t1": 16, "t2": 8, "t3": 8}),
        "first_batch_off": _first_batch_on_rank(rank, world, None),
        "first_batch_on": _first_batch_on_rank(rank, world, "COMPILE_STAGE"),
    }
    os.environ.pop("TORCH_TPU_SPMD_HANDSHAKE_STAGE", None)
    return out


@pytest.fixture(scope="module")
def cases() -> dict[str, list[dict[str, Any]]]:
    ranks = run_ranks(_every_case, 2)
    return {name: [r[name] for r in ranks] for name in ranks[0]}


@pytest.mark.multiprocess
def test_the_ranks_stacks_take_the_largest_limits_any_rank_has(cases):
    ranks = cases["same_stacks"]
    # one stack per rank (both tables of dim 8), bounded by its own tables' measured limits
    assert ranks[0]["before"] != ranks[1]["before"]
    assert ranks[0]["after"] == ranks[1]["after"]
    for seen in ranks:
        (ids, uniq), *_ = seen["after"]
        assert len(seen["after"]) == 1
        assert ids == max(r["before"][0][0] for r in ranks) and uniq == max(r["before"][0][1] for r in ranks)
    assert [r["raised"] for r in ranks] == [int(r["before"] != r["after"]) for r in ranks]
    assert all(r["same"] for r in ranks)
    assert sum(r["raised"] for r in ranks) >= 1


@pytest.mark.multiprocess
def test_ranks_whose_stacks_differ_keep_their_own_limits(cases):
    # t1 of dim 16: rank 0 has two stacks (dims 8 and 16), rank 1 one: their graphs differ anyway
    ranks = cases["other_stacks"]
    assert len(ranks[0]["before"]) == 2 and len(ranks[1]["before"]) == 1
    for seen in ranks:
        assert seen["after"] == seen["before"] and seen["raised"] == 0


def _first_batch_on_rank(rank: int, world: int, stage: str | None) -> dict[str, Any]:
    """Limits left to the first batch (fixed, no limits file): each rank sets its own from its batch
    (rank 1's ids more crowded), then `after_first_batch` with or without a handshake stage."""
    import os

    import torch.distributed as dist
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import tpurec
    from tpurec.sharding.rank_limits import _kernels, after_first_batch

    os.environ.pop("TORCH_TPU_SPMD_HANDSHAKE_STAGE", None)
    if stage:
        os.environ["TORCH_TPU_SPMD_HANDSHAKE_STAGE"] = stage
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=64, feature_names=[f"f{t[1:]}"]) for t in LIMITS
    ]
    ebc = EmbeddingBagCollection(tables)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {t: table_wise(rank=r) for t, r in PLACE.items()})})
    dmp = tpurec.DistributedModelParallel(ebc, device="cpu", plan=plan, fixed_limits=True)
    # this rank's part of the global batch: f0, f1 (on rank 0) spread; f2, f3 (on rank 1) on few rows
    values = torch.cat([torch.arange(16) * 4, torch.arange(16) * 4, torch.zeros(16), torch.zeros(16)]).long()
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=torch.ones(64, dtype=torch.long))
    dmp(kjt).wait()  # the first batch sets each stack's limits
    before = [k.inputs.stack_limits(i) for _, k in _kernels(dmp) for i in range(len(k.inputs.stacks))]
    changed = after_first_batch(dmp, dist.group.WORLD, world)
    after = [k.inputs.stack_limits(i) for _, k in _kernels(dmp) for i in range(len(k.inputs.stacks))]
    return {"before": before, "after": after, "changed": changed}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["COMPILE_STAGE", None])
def test_limits_the_first_batch_set_are_aligned_when_the_handshake_is_on(cases, stage):
    ranks = cases["first_batch_on" if stage else "first_batch_off"]
    assert ranks[0]["before"] != ranks[1]["before"]  # each rank's own first batch
    if stage:
        assert ranks[0]["after"] == ranks[1]["after"]
        assert [r["changed"] for r in ranks] == [r["before"] != r["after"] for r in ranks]
        assert any(r["changed"] for r in ranks)
    else:  # no handshake: nothing is exchanged or changed
        assert all(r["after"] == r["before"] and not r["changed"] for r in ranks)
