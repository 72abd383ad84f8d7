"""Ids of another dtype on one rank (issue #43): refused in one line on every rank, never an abort.

Before: a rank feeding int32 or float32 ids while the other fed int64 killed the job with SIGABRT
(gloo: "Received data size doesn't match") in the input dist's all-to-all, before any check of the
KJT ran. Now the ranks agree their KJTs' dtypes before the first collective carrying ids
(tpurec.sharding.host_input_dist.agree_id_dtypes).

Two real gloo ranks; a refusal leaves the process group usable (no rank entered the all-to-all),
shown by a good step after the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from tests.sharding.multiprocess import run_ranks

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f"f{i}"]) for i in range(2)
]


def _kjt(values_dtype: torch.dtype, lengths_dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    lengths = torch.tensor([1, 2, 1, 1], dtype=lengths_dtype)
    values = torch.tensor([1, 2, 3, 4, 5]).to(values_dtype)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, stride=2)


def _steps(rank, world_size):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    import tpurec
    from tpurec.errors import UserError

    ebc = EmbeddingBagCollection(tables=TABLES)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {t.name: row_wise() for t in TABLES})})
    model = tpurec.DistributedModelParallel(ebc, device="cpu", plan=plan)
    said = []
    odd = [(torch.int32, torch.int64), (torch.float32, torch.int64), (torch.int64, torch.int32)]
    for values_dtype, lengths_dtype in odd:
        kjt = _kjt(values_dtype, lengths_dtype) if rank == 1 else _kjt(torch.int64)
        try:
            model(kjt)
            said.append(None)
        except UserError as e:
            said.append(str(e))
    out = model(_kjt(torch.int64)).values()  # the group still works: nobody entered the all-to-all
    return said, tuple(out.shape)


@pytest.mark.multiprocess
def test_a_rank_feeding_ids_of_another_dtype_is_refused_on_every_rank():
    results = run_ranks(_steps, 2, timeout=120)  # the old code aborted rank 1: no result, a timeout
    for said, shape in results:
        assert shape == (2, 8)
        int32, float32, lengths = said
        assert int32 == (
            "the ranks fed ids (KJT values) of different dtypes (int64 on rank 0; int32 on rank 1): every rank "
            "must feed the same dtype (int64 ids and lengths, as TorchRec's KeyedJaggedTensor makes them)"
        )
        assert "(int64 on rank 0; float32 on rank 1)" in float32
        assert lengths.startswith("the ranks fed lengths of different dtypes (int64 on rank 0; int32 on rank 1)")
        assert "\n" not in int32 + float32 + lengths
