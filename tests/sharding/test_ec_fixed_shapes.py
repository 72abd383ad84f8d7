"""The sharded EmbeddingCollection on the TPU path (fixed limits): its outputs and all-to-all keep fixed
shapes over batches with different id counts, and equal TorchRec's output distribution exactly.

On 2 gloo ranks, tables sharded table-wise, row-wise and column-wise at once. The fixed path
(tpurec/sharding/sequence_output.py) is asked for with `fixed_limits=True` (a TPU device's default);
the reference is the same model (same kernels) on TorchRec's own sequence output distribution. Every op on a
floating tensor of two or more dimensions (the embeddings' path; the host's index bookkeeping is
integer) is recorded by its shapes and arguments, as a TorchTPU program would be keyed.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchrec.distributed.model_parallel import DistributedModelParallel as TorchrecDMP
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from tpurec.sharding.ec_sharder import ShardedSparseCoreEC, SparseCoreECSharder

from . import ec_cases as c
from .dmp_cases import copy_full_into_shards, local_slice
from .multiprocess import run_ranks

STEPS = 6
PLANS = {
    "t0": lambda ws: table_wise(rank=1 % ws),
    "t1": lambda ws: row_wise(),
    "t2": lambda ws: column_wise(ranks=[0, 1]),
}


class _Programs(TorchDispatchMode):
    """Each op on a floating tensor of 2+ dims: (op, shapes and dtypes, non-tensor arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        if str(func).startswith("aten._embedding_bag"):  # the CPU reference's lookup: on a TPU the SparseCore
            return func(*args, **(kwargs or {}))  # op, fixed by its limits (test_sequence_on_standin.py)
        if any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 for x in flat):
            key = tuple(
                (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else x
                for x in flat
                if isinstance(x, (torch.Tensor, int, float, bool, type(None)))
            )
            self.keys.add((str(func), key))
        return func(*args, **(kwargs or {}))


def _build(world_size, init_state, fixed=True):
    ec = EmbeddingCollection(tables=c.tables(), device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.1})
    # the planned capacity: ids per feature of a rank's batch (<= 4 samples x 5) and of a lookup (x 2 ranks)
    sharder = SparseCoreECSharder(num_sparsecores=4, fixed_limits=fixed, max_ids_per_feature=48)
    per_param = {n: c._ours(PLANS[n](world_size)) for n, _, _ in c.TABLES}
    module_plan = construct_module_sharding_plan(
        ec,
        per_param_sharding=per_param,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
        sharder=sharder,
    )
    model = TorchrecDMP(
        ec,
        env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": module_plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    copy_full_into_shards(model, init_state)
    return model


def _train(model, rank, world_size):
    """Per step: {feature: (values, lengths)} and the step's program keys (forward and backward)."""
    outs, programs = [], []
    for kjt, upstream in c.global_batches(STEPS, 8, seed=5):
        local = local_slice(kjt, rank, world_size)
        ups = c.local_upstream(kjt, upstream, rank, world_size)
        # the consumer: each feature's upstream gradient padded, on the host, to the output's rows
        mode = _Programs()
        with mode:
            out = model(local)
        padded = {k: _pad(ups[k], out[k].values().shape[0]) for k in c.KEYS}
        with mode:
            sum((out[k].values() * padded[k]).sum() for k in c.KEYS).backward()
        programs.append(mode.keys)
        outs.append({k: (out[k].values().detach().clone(), out[k].lengths().clone()) for k in c.KEYS})
    return outs, programs


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, torch.zeros(rows - t.shape[0], t.shape[1])]) if rows > t.shape[0] else t


def run_fixed_and_torchrec(rank, world_size, init_state):
    fixed = _build(world_size, init_state, True)
    outs, programs = _train(fixed, rank, world_size)
    ref = _build(world_size, init_state, True)  # the same kernels (fixed limits), TorchRec's output path:
    for m in ref.modules():
        if isinstance(m, ShardedSparseCoreEC):
            m._fixed_output = None
    ref_outs, _ = _train(ref, rank, world_size)
    return {
        "outs": outs,
        "ref_outs": ref_outs,
        "tables": c.gather_tables(fixed, rank),
        "ref_tables": c.gather_tables(ref, rank),
        "programs_by_step": programs,
    }


@pytest.mark.multiprocess
def test_fixed_shape_output_equals_torchrecs_and_compiles_nothing_after_warmup(monkeypatch):
    # the SparseCore ops (torch.ops.tpurec.*, one recorded op each), not the direct CPU step's own ops
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    init = EmbeddingCollection(tables=c.tables()).state_dict()
    results = run_ranks(run_fixed_and_torchrec, 2, init, timeout=600)
    for rank, r in enumerate(results):
        for step, (got, want) in enumerate(zip(r["outs"], r["ref_outs"])):
            for k in c.KEYS:
                values, lengths = got[k]
                ref_values, ref_lengths = want[k]
                n = ref_values.shape[0]
                assert torch.equal(lengths, ref_lengths), (rank, step, k)
                assert values.shape[0] >= n and torch.equal(values[:n], ref_values), (rank, step, k)
                assert not values[n:].any(), (rank, step, k)  # rows past the ids: zeros
        # the id counts differ from step to step, and so would TorchRec's shapes
        assert len({tuple(v.shape for v, _ in step.values()) for step in r["ref_outs"]}) > 2
        warm = r["programs_by_step"][0] | r["programs_by_step"][1]
        late = set().union(*r["programs_by_step"][2:]) - warm
        assert not late, sorted(late)[:5]
    for key, want in results[0]["ref_tables"].items():
        assert torch.equal(results[0]["tables"][key], want), key
