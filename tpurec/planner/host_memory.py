"""Host memory per TPU device: what the host tier's tables and optimizer state may take.

A TPU topology's `ddr_cap` (TorchRec's Topology field for host DRAM) is the host memory of a device's
share of its VM: the VM's RAM over its devices. TorchRec's partitioner then budgets it per device as
it budgets HBM (`Storage.ddr` of a shard: its host-tier rows), after the reservation keeps
HOST_HEADROOM_FRACTION of it for everything else a host runs. A CPU rank's tables live in that same
memory, so a `cpu-N` topology has one memory, `ddr_cap`, for both tiers (topology.cpu_spec).
"""

from __future__ import annotations

GiB = 1024**3
GB = 10**9

# Host RAM per chip, each next to its source; "guess" where no figure was read.
HOST_BYTES_PER_CHIP = {
    # cloud.google.com/tpu/docs/v5e, "VM types": ct5lp-hightpu-1t/-4t/-8t have 48/192/384 GB of RAM for
    # 1/4/8 chips (the page's "DRAM per host" is 512 GiB, more than a VM gets)
    "v5e": 48 * GB,
    # cloud.google.com/tpu/docs/v6e: "DRAM per host 1536 GiB", "chips per host 8"
    "v6e": 1536 * GiB // 8,
    # cloud.google.com/tpu/docs/v5p: "RAM (GB) (4-chip VM) 448"
    "v5p": 448 * GB // 4,
    # guess: v5p's 112 GB per chip (no figure read for v4 VMs)
    "v4": 448 * GB // 4,
    # guess: v6e's 192 GiB per chip (no figure read for tpu7x VMs)
    "v7x": 1536 * GiB // 8,
}
# Of a device's host memory, the share kept for the input pipeline, Python, the runtime and the
# data: a guess, reported with the plan's other assumptions.
HOST_HEADROOM_FRACTION = 0.25


def host_bytes_per_device(generation: str, devices_per_chip: int) -> int:
    """The host memory the planner gives each device of `generation` (0 for one it does not know)."""
    return HOST_BYTES_PER_CHIP.get(generation, 0) // max(1, devices_per_chip)
