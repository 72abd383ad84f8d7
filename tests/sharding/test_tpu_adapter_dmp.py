"""tpurec.DistributedModelParallel through the real TPU adapter and the TorchTPU stand-in, on real ranks.

Each rank runs the same sharded training twice from the same tables: once on the CPU reference
kernels, once with the TPU adapter's kernels routed to the stand-in of TorchTPU's ops; outputs and
tables must match exactly, and the adapter run must compile one program per stack and op.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from . import dmp_cases as c
from .multiprocess import run_ranks

CASES = [
    dict(sharding="row_wise", optim="rowwise_adagrad", pooling="SUM", weighted=True),
    dict(sharding="table_wise", optim="adam", pooling="MEAN", weighted=False),
    dict(sharding="column_wise", optim="sgd", pooling="SUM", weighted=False),
]
STEPS = 4


def _both_ways(rank, world_size, cases, init_state, steps):
    from tpurec.emulation import torchtpu_ops as tpu_standin

    # Fixed limits as on a TPU (shapes must not change), set from the first batch.
    c.SparseCoreEBCSharder = functools.partial(c.SparseCoreEBCSharder, fixed_limits=True, allow_id_dropping=True)
    reference = c.run_cases(rank, world_size, cases, init_state, steps)
    standin = tpu_standin.install(sparsecores=2)  # dmp_cases builds its sharder with 2 SparseCores
    with tpu_standin.adapter_on_cpu():
        adapted = c.run_cases(rank, world_size, cases, init_state, steps)
    return reference, adapted, standin.compile_keys()


@pytest.mark.multiprocess
# 2 ranks in make test-all (default suite time: 6-17 s here); the 1-rank case stays, and
# test_table_dtypes_dmp.py takes row-wise shards through the adapter at 2 ranks
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dmp_through_the_tpu_adapter_equals_the_reference(world_size):
    init = EmbeddingBagCollection(c.tables()).state_dict()
    results = run_ranks(_both_ways, world_size, CASES, init, STEPS, timeout=600)
    for rank, (reference, adapted, keys) in enumerate(results):
        assert keys, f"rank {rank}: the adapter never reached TorchTPU's ops"
        # One program per (op, stack): every key seen once per step of every case that uses it.
        assert all(count % STEPS == 0 for count in keys.values()), keys.values()
        for k, case in enumerate(CASES):
            for a, b in zip(adapted[k]["outs"], reference[k]["outs"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{case}, rank {rank}: {m}")
            for key, want in reference[k]["tables"].items():
                got = adapted[k]["tables"][key]
                if want is not None:
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{case} {key}: {m}")
