"""Dims 4, 12 and 20 (TorchRec accepts any dim) under tpurec's DMP equal stock TorchRec's fused kernel."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from . import dmp_cases as c
from .multiprocess import run_ranks

ODD_TABLES = [("t0", 40, 4, ["f0"]), ("t1", 27, 12, ["f1", "f2"]), ("t2", 64, 20, ["f3"])]
CASES = [
    dict(sharding=s, optim=o, pooling="SUM", weighted=False, stock=True)
    for s in ("table_wise", "column_wise", "row_wise")
    for o in ("sgd", "rowwise_adagrad")
]


def _odd_dims(rank, world_size, cases, steps, pad_dims):
    import functools

    c.TABLES[:] = ODD_TABLES
    c.SparseCoreEBCSharder = functools.partial(c.SparseCoreEBCSharder, pad_dims=pad_dims)
    init = EmbeddingBagCollection(c.tables()).state_dict()
    torch.manual_seed(0)
    return c.run_cases(rank, world_size, cases, init, steps)


@pytest.mark.multiprocess
# True: stored 8 wide, as on a TPU. False in make test-all (default suite time: 11 s here): the padded
# case stays, and tests/embedding/test_any_dim.py checks both against FBGEMM
@pytest.mark.parametrize("pad_dims", [pytest.param(False, marks=pytest.mark.slow), True])
def test_dims_4_12_20_train_like_stock_torchrec(pad_dims):
    results = run_ranks(_odd_dims, 2, CASES, 3, pad_dims, timeout=600)
    for k, case in enumerate(CASES):
        for rank in range(2):
            for got, want in zip(results[rank][k]["outs"], results[rank][k]["stock"]["outs"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: {m}")
        for key, want in results[0][k]["stock"]["tables"].items():
            assert want.shape[1] in (4, 12, 20)
            torch.testing.assert_close(
                results[0][k]["tables"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {key}: {m}"
            )
