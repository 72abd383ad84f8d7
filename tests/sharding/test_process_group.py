"""The process group DMP starts when the caller has none: gloo on CPU, gloo + TorchTPU's tpu_dist on a TPU."""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from tpurec.sharding import dmp


def test_backend_per_device_type():
    assert dmp.process_group_backend("cpu") == "gloo"
    # gloo alone has no backend for tpu tensors; CPU tensors still need gloo.
    tpu = dmp.process_group_backend("tpu")
    assert BackendConfig(dist.Backend(tpu)).get_device_backend_map() == {"cpu": "gloo", "tpu": "tpu_dist"}


def test_tpu_device_starts_the_tpu_backend_with_a_store(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    dmp._ensure_process_group("tpu")
    ((backend, kw),) = calls
    assert backend == "cpu:gloo,tpu:tpu_dist"
    # TorchTPU's uneven all-to-all needs a c10d Store: a TCP init method gives the group one.
    assert kw["init_method"].startswith("tcp://127.0.0.1:") and kw["world_size"] == 1 and kw["rank"] == 0
