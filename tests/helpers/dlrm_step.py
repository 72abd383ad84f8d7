"""The DLRM case of the compiled and pipelined step tests (tests/sharding/test_compiled_dmp_step.py,
test_pipelined_step.py and the tests built on them): TorchRec's DLRMTrain sharded by tpurec's DMP with
fixed id limits (`dlrm_dmp`), its table shards (`table_shards`), the trainer's optimizer and lr schedule
(`trainer_optimizer`), and batch streams: consecutive batches on disjoint rows (`disjoint_batches`),
some of them over their fixed id limits (`over_stream`)."""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.dlrm_case import FEATURES, ROWS, batches, dlrm_train

BATCH, DENSE_LR, TABLE_LR = 32, 0.05, 0.1
MIXED = {"t0": "table_wise", "t1": "row_wise", "t2": "column_wise", "t3": "table_row_wise"}


def dlrm_dmp(
    world_size: int, sharding_types: dict[str, str] | None, pooling: str = "SUM", constraints: Any = None
) -> Any:
    """TorchRec's DLRMTrain over FEATURES tables of ROWS x DIM, sharded by tpurec's DMP; fixed id
    limits (64 per partition) give every batch the same SparseCore shapes: one graph for all.
    constraints: ParameterConstraints by table, in place of those `sharding_types` makes."""
    from torchrec.distributed.planner.types import ParameterConstraints

    torch.manual_seed(0)
    model = dlrm_train(pooling, TABLE_LR)
    if constraints is None and sharding_types:
        constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in sharding_types.items()}
    return fixed_limits_dmp(model, constraints)


def fixed_limits_dmp(model: Any, constraints: Any = None) -> Any:
    """`model` sharded by tpurec's DMP on the CPU (batch BATCH), its EBCs with fixed id limits (64 per
    partition); constraints: TorchRec's ParameterConstraints by table, or None."""
    import tpurec
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    return tpurec.DistributedModelParallel(
        model,
        device="cpu",
        batch_size=BATCH,
        constraints=constraints,
        sharders=[SparseCoreEBCSharder(max_ids_per_partition=64)],
    )


def table_shards(dmp: Any) -> dict[str, torch.Tensor]:
    """This rank's table shards, by state-dict key (local shards of the ShardedTensors)."""
    out = {}
    for key, value in dmp.state_dict().items():
        if "embedding_bags" in key and value.local_shards():  # TW at 2 ranks: some tables live elsewhere
            out[key] = torch.cat([s.tensor.flatten() for s in value.local_shards()]).clone()
    return out


def trainer_optimizer(dmp: Any, kind: str) -> Any:
    """The trainer's optimizer (tpurec.dlrm.model.build_optimizer's shape: the fused table optimizer
    and the dense torch.optim one in a CombinedOptimizer) and its LRSchedule: 5 steps of warm-up,
    then a quadratic decay from step 8 over 15 steps (every step of the 20 has another lr)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.dlrm.model import LRSchedule, _optimizer

    cls, kwargs = _optimizer(kind, DENSE_LR, 1e-8)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: cls(ps, **kwargs)
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return optimizer, LRSchedule(optimizer, warmup_steps=5, decay_start=8, decay_steps=15)


def disjoint_batches(n: int, batch: int, rank: int, world_size: int) -> list:
    """dlrm_case's batches with each id folded into the lower half of its table's rows on even
    steps and the upper half on odd ones: consecutive batches share no row of any table."""
    out = batches(n, batch, rank, world_size)
    for t, b in enumerate(out):
        ids = b.sparse_features.values()
        ids.copy_(ids % (ROWS // 2) + (ROWS // 2) * (t % 2))
    return out


OVER_STEPS = 8  # the streams below: batch 3 and the last over their fixed id limits


def over_the_limits(batch: Any, upper: bool, rows_of: Any) -> Any:
    """`batch` with 20 ids per bag of f0 on rows 0, 4, .., 76 (+100 if `upper`: disjoint from the
    batches before and after it): one partition of four (MOD sharding) gets 160 ids from each
    SparseCore's 8 samples, over the limit of 64, so the batch runs as several passes. Its other
    features take the ids of `rows_of` (the batch before it): rows repeat across this batch, where
    only a drained pipeline (no lookup ahead of an update) gives the eager step's numbers."""
    from dataclasses import replace

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.ones(FEATURES * BATCH, dtype=torch.long)
    lengths[:BATCH] = 20
    f0 = (torch.arange(20 * BATCH) % 20) * 4 + (ROWS // 2 if upper else 0)
    values = torch.cat([f0, rows_of.sparse_features.values()[BATCH:]])
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(FEATURES)], values=values, lengths=lengths)
    return replace(batch, sparse_features=kjt)


def over_stream(n: int, rank: int, world_size: int) -> list:
    """`disjoint_batches` with batch 3 and the last (n - 1) over their limits, sharing rows of f1-f3
    with the batches before and after them."""
    out = disjoint_batches(n, BATCH, rank, world_size)
    for t in (3, n - 1):
        out[t] = over_the_limits(out[t], upper=t % 2 == 1, rows_of=out[t - 1])
    return out
