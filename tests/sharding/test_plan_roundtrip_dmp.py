"""A plan planned by tpurec, saved to JSON and loaded back, drives tpurec's DMP to the same model."""

import pytest
import torch

from .multiprocess import run_ranks


def _plan_save_load_shard(rank, world_size, path):
    import torch.distributed as dist
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.planner import plan_io

    from . import dmp_cases as c

    def model():
        ebc = EmbeddingBagCollection(c.tables(), device=torch.device("meta"))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
        return ebc

    init = EmbeddingBagCollection(c.tables()).state_dict() if rank == 0 else None
    box = [init]
    dist.broadcast_object_list(box, src=0)
    planned = tpurec.DistributedModelParallel(model(), device="cpu", batch_size=8)
    if rank == 0:
        plan_io.save_plan(planned.plan, path)
    dist.barrier()
    loaded = tpurec.DistributedModelParallel(model(), device="cpu", plan=plan_io.load_plan(path))
    outs = []
    for m in (planned, loaded):
        m.load_state_dict(box[0])
        outs.append(c.eval_outputs(m, rank, world_size))
    return {
        "same_plan": str(planned.plan) == str(loaded.plan),
        "outs": outs,
        "kernels": sorted({ps.compute_kernel for mp in loaded.plan.plan.values() for ps in mp.values()}),
    }


# default suite time: 5-15 s here; tests/planner/test_plan_io.py's loaded plan sharding at 1 rank and
# tests/dlrm/test_train_host_tier.py's saved plan trained again stay
@pytest.mark.slow
@pytest.mark.multiprocess
def test_saved_and_loaded_tpurec_plan_shards_identically(tmp_path):
    for r in run_ranks(_plan_save_load_shard, 2, str(tmp_path / "plan.json"), timeout=600):
        assert r["same_plan"] and r["kernels"] == ["customized_kernel"]
        for a, b in zip(*r["outs"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
