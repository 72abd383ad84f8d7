"""TorchRec's `output_dtype` fused param under tpurec's DMP (2 gloo ranks): lookups come back in that
dtype, as stock TorchRec's FBGEMM kernel returns them, and train as it does."""

from __future__ import annotations

import functools

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

from . import dmp_cases as c
from .multiprocess import run_ranks

CASES = [dict(sharding=s, optim="sgd", pooling="SUM", weighted=False, stock=True) for s in ("table_wise", "row_wise")]


def _with_output_dtype(rank, world_size, output_dtype, steps):
    import torchrec.distributed.embeddingbag as stock_ebc

    fused = {"output_dtype": output_dtype}
    c.SparseCoreEBCSharder = functools.partial(c.SparseCoreEBCSharder, fused_params=fused)
    stock_ebc.EmbeddingBagCollectionSharder = functools.partial(
        stock_ebc.EmbeddingBagCollectionSharder, fused_params=fused
    )
    torch.manual_seed(1)
    init = c.EmbeddingBagCollection(c.tables()).state_dict()
    return c.run_cases(rank, world_size, CASES, init, steps)


@pytest.mark.multiprocess
def test_fp16_output_dtype_matches_stock_torchrec_at_2_ranks():
    per_rank = run_ranks(_with_output_dtype, 2, SparseType.FP16, 3, timeout=600)
    for rank, results in enumerate(per_rank):
        for case, result in zip(CASES, results):
            for ours, stock in zip(result["outs"], result["stock"]["outs"]):
                assert ours.dtype == stock.dtype == torch.float16, (case, ours.dtype, stock.dtype)
                # both round the same float32 sums once; FP32 tables, so the sums agree to float32
                # rounding and the FP16 values to one FP16 step at most
                torch.testing.assert_close(ours.float(), stock.float(), rtol=1e-3, atol=1e-3)
            if rank == 0:
                for key, want in result["stock"]["tables"].items():
                    torch.testing.assert_close(result["tables"][key], want, rtol=1e-3, atol=1e-4)


def test_unsupported_output_dtype_is_refused_naming_the_tables():
    from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardedEmbeddingTable

    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag

    table = ShardedEmbeddingTable(
        **EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=16, feature_names=["f0"]).__dict__,
        local_rows=16,
        local_cols=8,
        fused_params={"output_dtype": SparseType.INT8},
    )
    config = GroupedEmbeddingConfig(
        data_type=DataType.FP32,
        pooling=table.pooling,
        is_weighted=False,
        has_feature_processor=False,
        compute_kernel=None,
        embedding_tables=[table],
    )
    with pytest.raises(ValueError, match=r"\['t0'\]: output_dtype .* not supported"):
        SparseCoreEmbeddingBag(config, torch.device("cpu"), num_sc_per_device=2)
