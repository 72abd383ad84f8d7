"""FP16 tables under tpurec's DMP (2 gloo ranks) train like stock TorchRec's fused kernel (FBGEMM), and,
widened to float32 as on a TPU, through the TPU adapter like float32 tables."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tests.embedding.helpers import assert_within_fp16_steps

from . import dmp_cases as c
from .multiprocess import run_ranks

CASES = [
    dict(sharding=s, optim=o, pooling="SUM", weighted=False, stock=True)
    for s, o in (("table_wise", "sgd"), ("column_wise", "rowwise_adagrad"), ("row_wise", "rowwise_adagrad"))
]


def _fp16(rank, world_size, cases, steps):
    plain = c.tables

    def fp16_tables(pooling=PoolingType.SUM):
        return [type(t)(**{**t.__dict__, "data_type": DataType.FP16}) for t in plain(pooling)]

    c.tables = fp16_tables
    torch.manual_seed(1)  # the same start on both ranks and in every run
    init = EmbeddingBagCollection(c.tables()).state_dict()
    torch.manual_seed(0)
    results = c.run_cases(rank, world_size, cases, init, steps)
    # what each side publishes: table dtypes in state_dict, optimizer state dtypes
    for case, result in zip(cases, results):
        for stock in (False, True):
            optim, kwargs = c.optimizer(case["optim"])
            model = c.build_sharded(
                rank, world_size, case["sharding"], optim, kwargs, PoolingType.SUM, False, init, stock
            )
            side = result["stock"] if stock else result
            side["dtypes"] = sorted({str(v.dtype) for v in model.state_dict().values()})
            if not stock:  # state_dict() shards are views: an in-place write (DCP's load) reaches the table
                for shard in model.state_dict()["embedding_bags.t0.weight"].local_shards():
                    shard.tensor.fill_(0.5)
                again = model.state_dict()["embedding_bags.t0.weight"].local_shards()
                side["in_place"] = all(bool((s.tensor == 0.5).all()) for s in again)
            state = model.fused_optimizer.state_dict()["state"]
            side["state_dtypes"] = sorted({str(s.dtype) for e in state.values() for s in e.values()})
    return results, _widened(rank, world_size, fp16_tables, plain, init, steps)


def _widened(rank, world_size, fp16_tables, plain, init, steps):
    """As on a TPU: FP16 tables widened to float32 (sharder widen_tables=True), through the TPU adapter
    and the TorchTPU stand-in, against float32 tables started from the same values on the reference."""
    import functools

    from tpurec.emulation import torchtpu_ops as tpu_standin

    sharder = c.SparseCoreEBCSharder
    cases = [dict(sharding="row_wise", optim="rowwise_adagrad", pooling="SUM", weighted=False)]
    c.tables, c.SparseCoreEBCSharder = plain, functools.partial(sharder, fixed_limits=True, allow_id_dropping=True)
    init32 = {k: v.float() for k, v in init.items()}
    reference = c.run_cases(rank, world_size, cases, init32, steps)
    c.tables = fp16_tables
    c.SparseCoreEBCSharder = functools.partial(sharder, fixed_limits=True, allow_id_dropping=True, widen_tables=True)
    tpu_standin.install(sparsecores=2)
    with tpu_standin.adapter_on_cpu():
        adapted = c.run_cases(rank, world_size, cases, init, steps)
    return reference, adapted


@pytest.mark.multiprocess
def test_fp16_tables_train_like_stock_torchrec_at_2_ranks_and_widened_through_the_tpu_adapter():
    per_rank = run_ranks(_fp16, 2, CASES, 3, timeout=600)
    results = [r[0] for r in per_rank]
    for _, (reference, adapted) in per_rank:
        for a, b in zip(adapted[0]["outs"], reference[0]["outs"]):  # widened: float32 all the way
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key, want in reference[0]["tables"].items():
            got = adapted[0]["tables"][key]  # the sharded state_dict publishes the widened float32 table
            if want is None:  # gathered on rank 0 only
                continue
            assert got.dtype == want.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for k, case in enumerate(CASES):
        for rank in range(2):
            mine, stock = results[rank][k], results[rank][k]["stock"]
            assert mine["dtypes"] == stock["dtypes"] == ["torch.float16"], case
            assert mine["state_dtypes"] == stock["state_dtypes"], case
            assert mine["in_place"], case
            # outputs: float32 sums of the same fp16 rows (SGD); row-wise Adagrad's rare one-fp16-step
            # weight difference (below) shows in a later output by that much
            atol = 1e-5 if case["optim"] == "sgd" else 2**-11
            for got, want in zip(mine["outs"], stock["outs"]):
                assert got.dtype == want.dtype == torch.float32
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{case}: {m}")
        for key, want in results[0][k]["stock"]["tables"].items():
            got = results[0][k]["tables"][key]
            assert got.dtype == want.dtype == torch.float16
            if case["optim"] == "sgd":  # both round w - round(lr g) to fp16: bit-equal
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{case} {key}: {m}")
            else:  # one fp16 step where the float32 row multiplier differs in its last bit
                assert_within_fp16_steps(got, want)
