"""The launch environment of an emulated slice, by the rules of TorchTPU's `set_tpu_launch_env()`.

torch-tpu 0.2.0 (`torch_tpu/_internal/distributed/distributed.py`) decides three variables in the
launching process, before the ranks start, because every rank must agree on them:
`TORCH_TPU_SLICEBUILDER_ADDRESSES` (one host:port per rank), `TORCH_TPU_TOPOLOGY` (the physical mesh)
and `TORCH_TPU_XPROF_SESSION_ID`. On several hosts it also derives `NNODES`, `NODE_RANK`,
`MASTER_ADDR` (the first of `TPU_WORKER_HOSTNAMES`) and `MASTER_PORT` (29500), and the addresses are
`<host>:<TORCH_TPU_BASE_PORT (8070) + i>` for every host and each of its devices; on one host they
are `localhost:<unused port>`. A real TPU launch calls TorchTPU's own function
(`tpurec.dlrm.slice_launch.torchtpu_launch_env`); the emulation computes the same variables here,
with one loopback address per emulated host (127.0.0.1, 127.0.0.2, ...).
"""

from __future__ import annotations

import socket
import time

from tpurec.planner.topology import SliceSpec

BASE_PORT = 8070  # TORCH_TPU_BASE_PORT's default (torch_tpu/_internal/distributed/distributed.py)


def host_address(host: int) -> str:
    """The loopback address standing for emulated host `host` (127.0.0.0/8 is all loopback)."""
    return f"127.0.0.{host + 1}"


def physical_topology(spec: SliceSpec) -> str:
    """TORCH_TPU_TOPOLOGY for the slice: its chips as a mesh ("2,2,2" for v5p-16, "4,4" for v6e-16).

    3D-torus generations (v5p, v7x): 2x2x1 for one host, 2x2x2 for 8 chips, then doubling z, y, x
    in turn (2x2x4, 2x4x4, 4x4x4, ...); 2D ones (v6e) double the shorter side (2x2, 2x4, 4x4, ...).
    These are the shapes Cloud TPU lists for those chip counts (cloud.google.com/tpu/docs/v5p, /v6e,
    /tpu7x, "topology" columns).
    """
    chips = spec.chips_per_slice
    if spec.generation.ici_shape.startswith("3D"):
        if chips < 8:
            return ",".join(map(str, [2, 2, 1] if chips == 4 else [chips, 1, 1]))
        dims, axis = [2, 2, 2], 2  # then z, y, x in turn: 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
        while dims[0] * dims[1] * dims[2] < chips:
            dims[axis] *= 2
            axis = (axis - 1) % 3
        return ",".join(map(str, dims))
    dims = [1, 1]
    while dims[0] * dims[1] < chips:
        dims[0 if dims[0] <= dims[1] else 1] *= 2
    return ",".join(map(str, sorted(dims)))


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulated_launch_env(spec: SliceSpec, session: str | None = None) -> list[dict[str, str]]:
    """One environment per host of `spec`, as set_tpu_launch_env() would leave it on that host."""
    session = session or str(time.time_ns())
    per_host = spec.devices_per_host
    common = {
        "TORCH_TPU_XPROF_SESSION_ID": session,
        "TORCH_TPU_TOPOLOGY": physical_topology(spec),
        "TORCH_TPU_DEVICES_PER_HOST": str(per_host),
    }
    if spec.hosts == 1:
        addresses = ",".join(f"localhost:{_unused_port()}" for _ in range(per_host))
        return [dict(common, TORCH_TPU_SLICEBUILDER_ADDRESSES=addresses)]
    hosts = [host_address(h) for h in range(spec.hosts)]
    addresses = ",".join(f"{h}:{BASE_PORT + i}" for h in hosts for i in range(per_host))
    port = str(_unused_port())  # not 29500: several emulations may share this machine
    return [
        dict(
            common,
            TPU_WORKER_HOSTNAMES=",".join(hosts),
            TORCH_TPU_SLICEBUILDER_ADDRESSES=addresses,
            NNODES=str(spec.hosts),
            NODE_RANK=str(h),
            MASTER_ADDR=hosts[0],
            MASTER_PORT=port,
        )
        for h in range(spec.hosts)
    ]
