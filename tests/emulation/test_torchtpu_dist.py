"""TorchTPU 0.2.0's distributed rules, as an emulated rank enforces them, on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from tests.sharding.multiprocess import run_ranks

LAUNCH = {
    "TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:8070,localhost:8071",
    "TORCH_TPU_TOPOLOGY": "2,1,1",
    "TORCH_TPU_XPROF_SESSION_ID": "1",
}


def _try(fn) -> str:
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return str(e)


def _rules(rank, world_size, env):
    import torch.distributed as dist

    from tpurec.emulation import torchtpu_dist

    for key in LAUNCH:
        os.environ.pop(key, None)
    os.environ.update(env)
    torchtpu_dist.install_device_module(rank, world_size)
    torchtpu_dist.register_backend()
    out = {}
    out["global"] = _try(lambda: dist.new_group(backend="cpu:gloo,tpu:tpu_dist"))
    if out["global"] == "ok":
        g = dist.new_group(backend="cpu:gloo,tpu:tpu_dist")
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t, group=g)  # the tensors still go through gloo
        out["sum"] = float(t)
        out["subgroup"] = _try(
            lambda: dist.new_group([0], backend="cpu:gloo,tpu:tpu_dist", use_local_synchronization=True)
        )
    return out


@pytest.mark.multiprocess
def test_tpu_dist_needs_the_launch_environment():
    for result in run_ranks(_rules, 2, {}):
        assert result["global"].startswith("missing required environment variables for distributed training")
        assert "TORCH_TPU_SLICEBUILDER_ADDRESSES" in result["global"]


@pytest.mark.multiprocess
def test_tpu_dist_global_group_works_and_sub_groups_are_refused():
    r0, r1 = run_ranks(_rules, 2, LAUNCH)
    assert r0["global"] == r1["global"] == "ok" and r0["sum"] == r1["sum"] == 3.0
    assert "cannot form a sub-group of ranks [0]" in r0["subgroup"] and "SPMD" in r0["subgroup"]
    assert r1["subgroup"] == "ok"  # not a member: nothing to create


@pytest.mark.multiprocess
def test_tpu_dist_refuses_a_local_rank_beyond_the_hosts_devices():
    env = dict(LAUNCH, TORCH_TPU_DEVICES_PER_HOST="1", LOCAL_RANK="3")
    for result in run_ranks(_rules, 2, env):
        assert result["global"].startswith("expected environment variable LOCAL_RANK to be in [0, 1)")


def test_strict_torch_tpu_refuses_torchrec_unless_the_flag_was_set_at_load(monkeypatch):
    from tpurec.emulation import torchtpu_dist

    monkeypatch.delenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", raising=False)
    module = torchtpu_dist.EmulatedTpuModule(0, 4)
    monkeypatch.setenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "1")  # too late: read at load
    with pytest.raises(torchtpu_dist.TorchTpuRuleError, match="internal to TorchTPU"):
        module.is_available()
    assert torchtpu_dist.EmulatedTpuModule(0, 4).is_available() is True


def test_ddp_shape_check_fails_on_several_hosts_and_tpurecs_wrapper_skips_it(monkeypatch):
    """torch-tpu 0.2.0 fails DDP's parameter check on several hosts (torchrec PR #4597); the
    wrapper tpurec's DMP uses on the TPU path skips it for the wrap only."""
    import torch.nn.parallel.distributed as ddp

    from tpurec.emulation import torchtpu_dist
    from tpurec.sharding.dmp import TpuDataParallelWrapper

    monkeypatch.setattr(ddp, "_verify_param_shape_across_processes", ddp._verify_param_shape_across_processes)
    torchtpu_dist.refuse_ddp_shape_check_across_hosts(2)
    with pytest.raises(torchtpu_dist.TorchTpuRuleError, match="transfer to 'cpu' device failed"):
        ddp._verify_param_shape_across_processes(None, [])
    seen = []

    class Probe(TpuDataParallelWrapper):
        def _ddp_wrap(self, dmp, env, device, ignore):
            seen.append(ddp._verify_param_shape_across_processes(None, []))

    Probe().wrap(_FakeDmp(), None, torch.device("cpu"))
    assert seen == [None]
    with pytest.raises(torchtpu_dist.TorchTpuRuleError):  # restored after the wrap
        ddp._verify_param_shape_across_processes(None, [])


class _FakeDmp:
    _dmp_wrapped_module = torch.nn.Linear(1, 1)

    def named_modules(self):
        return []


def _empty_sharded_tensor_device(rank, world_size):
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    import tpurec.sharding.dmp  # noqa: F401  (what tpurec's DMP installs)
    from tpurec.emulation import torchtpu_dist

    os.environ.update(LAUNCH)
    torchtpu_dist.install_device_module(rank, world_size)
    torchtpu_dist.register_backend()
    pg = dist.new_group(backend="cpu:gloo,tpu:tpu_dist")
    # A 1-row table placed on rank 0 only: rank 1 holds no shard of it (a table-wise plan's usual case).
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
    st = sharded_tensor.empty(spec, 1, 4, process_group=pg)
    return str(st.device), len(st.local_shards())


@pytest.mark.multiprocess
def test_a_rank_without_shards_answers_device_on_the_two_backend_group():
    """torch answered torch.cuda.current_device() (and crashed DCP's save) unless the backend is 'gloo'."""
    (d0, n0), (d1, n1) = run_ranks(_empty_sharded_tensor_device, 2)
    assert (d0, n0) == ("cpu", 1) and (d1, n1) == ("cpu", 0)


def _one_rank_ddp_steps(rank, world_size, env):
    """Two DDP steps of a small model on the emulated device, as tpurec's TPU wrapper leaves DDP on one
    rank: (the collectives asked of the device, the last step's gradients on the host)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tpurec.emulation import device, torchtpu_dist
    from tpurec.sharding.dmp import _skip_one_rank_all_reduce

    os.environ.update(LAUNCH, TORCH_TPU_SLICEBUILDER_ADDRESSES="localhost:8070", TORCH_TPU_TOPOLOGY="1,1,1")
    os.environ.update(env)
    torchtpu_dist.install_device_module(rank, world_size)
    torchtpu_dist.register_backend()
    torchtpu_dist.ddp_without_pinned_host_memory()
    pg = dist.new_group(backend="cpu:gloo,tpu:tpu_dist")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("tpu")
    ddp = DistributedDataParallel(model, device_ids=[0], process_group=pg, gradient_as_bucket_view=True)
    _skip_one_rank_all_reduce(ddp)
    x = torch.randn(32, 8).to("tpu")
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    collectives = sorted({op for kind, op, _ in device.RECORD.programs if kind == "collective"})
    return collectives, [p.grad.cpu() for p in model.parameters()]


@pytest.mark.multiprocess
def test_one_rank_ddp_skips_the_all_reduce_with_the_same_gradients():
    """On one rank DDP's bucket division and all-reduce change nothing but cost programs on TorchTPU:
    tpurec's wrapper hands DDP the buckets as they are (TPUREC_ONE_RANK_ALL_REDUCE=1 keeps them)."""
    ((skipped, grads),) = run_ranks(_one_rank_ddp_steps, 1, {"TPUREC_ONE_RANK_ALL_REDUCE": "0"})
    ((kept, expected),) = run_ranks(_one_rank_ddp_steps, 1, {"TPUREC_ONE_RANK_ALL_REDUCE": "1"})
    assert "c10d::allreduce_" in kept and "c10d::allreduce_" not in skipped
    assert len(grads) == len(expected) == 4 and all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert all(g.abs().sum() > 0 for g in grads)


def test_a_refusing_rank_waits_until_every_rank_of_the_group_has_refused():
    """The group's gloo half is built first; a rank that raised at once dropped its connections while
    another rank still made them (the "Gloo connectFullMesh failed" flake): each waits on the store."""
    import datetime
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from tpurec.emulation import torchtpu_dist

    store = dist.HashStore()
    options = SimpleNamespace(store=store, group_size=2, timeout=datetime.timedelta(seconds=20))
    returned = []
    first = threading.Thread(
        target=lambda: (torchtpu_dist._all_ranks_refused(options), returned.append(time.monotonic()))
    )
    first.start()
    time.sleep(0.3)
    assert not returned  # the other rank has not refused yet
    second_at = time.monotonic()
    torchtpu_dist._all_ranks_refused(options)
    first.join(timeout=5)
    assert returned and 0 <= returned[0] - second_at < 1.0
    # no peer ever comes: the wait ends at the group's timeout
    alone = SimpleNamespace(store=dist.HashStore(), group_size=2, timeout=datetime.timedelta(seconds=0.2))
    t0 = time.monotonic()
    torchtpu_dist._all_ranks_refused(alone)
    assert 0.2 <= time.monotonic() - t0 < 2
