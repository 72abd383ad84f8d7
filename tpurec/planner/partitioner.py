"""TorchRec's greedy partitioner with its uniform placement done in one pass of plain numbers.

`GreedyPerfPartitioner.partition` places uniform options (row-wise, data-parallel: shard i on
device i) first, one shard at a time, building a new `Storage` and a new `Perf` per shard; on a
128-device slice that is most of the planner's time (MLPerf DCNv2 on v5p-128: ~0.5 s of ~1.8 s,
185 proposals x 26 tables x 128 shards). It names the step by class
(`GreedyPerfPartitioner._uniform_partition`), so a subclass cannot replace just that step; this one
places the uniform options itself and hands TorchRec's partition the rest on devices that already
hold them. The result is the same as TorchRec's: each device's storage and perf are summed in the
same order (float addition order kept), the same ranks are set, the same error is raised when a
shard does not fit (a group that fits on no device or host names, as its `param_count`, the module's
options TorchRec was left to place, not all of them: the count only orders groups when
`balance_modules` is on, and then TorchRec places everything).
"""

from __future__ import annotations

import copy
from typing import List

from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import (
    DeviceHardware,
    PartitionByType,
    Perf,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Storage,
    Topology,
)

_PERF_FIELDS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms", "prefetch_compute")


class TpuPartitioner(GreedyPerfPartitioner):
    def partition(
        self,
        proposal: List[ShardingOption],
        storage_constraint: Topology,
        hbm_per_device: int | None = None,
    ) -> List[ShardingOption]:
        uniform = [o for o in proposal if o.partition_by == PartitionByType.UNIFORM.value]
        if not uniform or self._balance_modules:  # balance_modules counts every option of a module
            return super().partition(proposal, storage_constraint, hbm_per_device)
        devices = storage_constraint.devices
        placed = _place_uniform(uniform, devices, hbm_per_device)
        loaded = copy.copy(storage_constraint)  # the partitioner reads only its devices and sizes
        loaded._devices = placed
        super().partition([o for o in proposal if o.partition_by != PartitionByType.UNIFORM.value], loaded)
        return proposal


def _place_uniform(
    options: List[ShardingOption], devices: List[DeviceHardware], hbm_per_device: int | None
) -> List[DeviceHardware]:
    """Sets each shard's rank and returns the devices with the shards' storage taken and perf added,
    as `GreedyPerfPartitioner._uniform_partition` does on copies of `devices`."""
    n = len(devices)
    hbm = [hbm_per_device or d.storage.hbm for d in devices]
    ddr = [d.storage.ddr for d in devices]
    ssd = [d.storage.ssd for d in devices]
    perf = [[getattr(d.perf, f) for d in devices] for f in _PERF_FIELDS]
    fc, fm, bc, bm, idc, pc = perf
    ranks = [d.rank for d in devices]
    for option in options:
        if option.num_shards != n:
            raise PlannerError(
                error_type=PlannerErrorType.PARTITION,
                message=f"For a uniform partition, the number of shards ({option.num_shards}) must equal "
                f"the number of devices ({n})",
            )
        for i, shard in enumerate(option.shards):
            s = shard.storage
            p = shard.perf
            assert s is not None and p is not None  # set by the estimators
            if s.hbm > hbm[i] or s.ddr > ddr[i] or s.ssd > ssd[i]:
                raise PlannerError(
                    error_type=PlannerErrorType.PARTITION,
                    message=f"Shard of size {s} bytes does not fit on any rank. "
                    f"Device memory cap: {Storage(hbm[i], ddr[i], ssd[i])}.",
                )
            shard.rank = ranks[i]
            hbm[i] -= s.hbm
            ddr[i] -= s.ddr
            ssd[i] -= s.ssd
            fc[i] += p.fwd_compute
            fm[i] += p.fwd_comms
            bc[i] += p.bwd_compute
            bm[i] += p.bwd_comms
            idc[i] += p.input_dist_comms
            pc[i] += p.prefetch_compute
    return [
        DeviceHardware(
            rank=ranks[i],
            storage=Storage(hbm=hbm[i], ddr=ddr[i], ssd=ssd[i]),
            perf=Perf(fc[i], fm[i], bc[i], bm[i], idc[i], pc[i]),
        )
        for i in range(n)
    ]
