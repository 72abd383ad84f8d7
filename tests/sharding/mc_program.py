"""A TorchRec program with a managed-collision EBC (MCH remap, LRU eviction), run by
tests/sharding/test_mc_dmp.py under `tpurec launch --emulate-tpu` (device "tpu") and under torchrun (device
"cpu"). Rank 0 prints one JSON line: losses, evictions, where the remapped ids live, and on an emulated
rank what its device saw (programs compiled after warm-up, device->host copies by call site)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.sharding.mc_cases

STEPS = 12


def main(device: str) -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tests.sharding.mc_cases import _loss, batches, build
    from tpurec.runtime.device import emulated_slice

    torch.manual_seed(0)
    model: Any = build("lru", True)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.mc._embedding_module.parameters(), {"lr": 0.05, "eps": 1e-3})
    dmp = tpurec.DistributedModelParallel(model, device=device)
    rank = dist.get_rank()
    emulated = None
    if emulated_slice():
        from tpurec.emulation.rank import current

        emulated = current()
    sharded = dmp.module.mc
    evicted: list[int] = []
    evict = sharded._evict

    def counting_evict(per_table):
        evicted.append(sum(int(v.numel()) for v in per_table.values() if v is not None))
        evict(per_table)

    sharded._evict = counting_evict
    torch.manual_seed(100 + rank)  # the evictions' re-init draws
    losses, remap_devices = [], set()
    for kjt in batches(STEPS, rank):
        if emulated is not None:
            emulated.begin("train")
        out, remap = dmp(kjt)
        loss = _loss(out, True)
        loss.backward()
        losses.append(float(loss.detach()))
        remap_devices.add(str(remap.values().device))
    if rank == 0:
        report = {"losses": losses, "evicted": sum(evicted), "remapped_on": sorted(remap_devices)}
        if emulated is not None:
            report |= {
                "recompiles_after_warmup": emulated.recompiles_after_warmup(),
                "late_programs": sorted({f"{kind} {op}" for kind, op, _ in emulated.late_programs()}),
                "device_to_host_copies": emulated.train_copies(),
            }
        print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
