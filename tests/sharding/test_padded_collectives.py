"""The padded (even-only) all-to-all path gives the same training as the plain one, on real ranks."""
import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from . import dmp_cases as c
from .multiprocess import run_ranks

CASES = [dict(sharding="row_wise", optim="rowwise_adagrad", pooling="SUM", weighted=True),
         dict(sharding="table_wise", optim="sgd", pooling="MEAN", weighted=False)]


def _uneven(rank, world_size):
    import torch.distributed as dist

    from tpurec.sharding import collectives

    collectives.install(force=True)
    # rank r sends r+1+j rows to rank j
    in_splits = [rank + 1 + j for j in range(world_size)]
    out_splits = [j + 1 + rank for j in range(world_size)]
    inp = torch.cat([torch.full((n, 3), float(100 * rank + j)) for j, n in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 3)
    dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True).wait()
    return out, out_splits, collectives.calls["padded"]


@pytest.mark.multiprocess
def test_padded_uneven_all_to_all_delivers_exact_chunks():
    for rank, (out, splits, padded) in enumerate(run_ranks(_uneven, 3)):
        want = torch.cat([torch.full((n, 3), float(100 * j + rank)) for j, n in enumerate(splits)])
        assert torch.equal(out, want) and padded == 1


@pytest.mark.multiprocess
def test_training_through_padded_collectives_matches_plain():
    init = EmbeddingBagCollection(c.tables()).state_dict()
    plain = run_ranks(c.run_cases, 2, CASES, init, 2, timeout=600)
    padded = run_ranks(c.run_cases_padded, 2, CASES, init, 2, timeout=600)
    for k in range(len(CASES)):
        assert padded[0][k]["padded_calls"] > 0
        for r in range(2):
            for a, b in zip(plain[r][k]["outs"], padded[r][k]["outs"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key, v in plain[0][k]["tables"].items():
            torch.testing.assert_close(padded[0][k]["tables"][key], v, rtol=0, atol=0)
