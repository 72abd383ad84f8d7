"""The launch environment of an emulated slice: each host given what a Cloud TPU VM gives it, then
TorchTPU's `set_tpu_launch_env()` rules applied there, as on the real host.

A real multi-host launch (`tpurec.launch.hosts.tpu_agent`) takes this host's index and the
slice's hostnames from the TPU VM (`tpurec.runtime.tpu_vm.cloud_tpu_host_env`: `TPU_WORKER_ID` / `TPU_WORKER_HOSTNAMES`
when set, as GKE sets them, else the metadata server's `agent-worker-number` and
`worker-network-endpoints`), hands them to TorchTPU as `JOB_COMPLETION_INDEX` and
`TPU_WORKER_HOSTNAMES`, and runs TorchTPU's own `set_tpu_launch_env(nnodes=H)` in a child. The
emulation runs the same `cloud_tpu_host_env` against a metadata server of its own (host `h` is
worker `h`; the workers are the loopback addresses 127.0.0.1, 127.0.0.2, ...) and then
`set_tpu_launch_env_rules`, which is torch-tpu 0.2.0's `set_tpu_launch_env`
(`torch_tpu/_internal/distributed/distributed.py`) line for line, with the host's devices as TorchTPU
finds them on PCI (`torch_tpu/_internal/utils/hardware.py`). A test in the TorchTPU venv
(tests/emulation/test_torchtpu_launch_env.py) runs TorchTPU's real function on the same inputs and
compares every variable.

Where the emulation differs, and why: the hostnames are loopback addresses (every host is this
machine), and `MASTER_PORT` is pinned from the outside to an unused port, not TorchTPU's 29500 (several
emulations may share this machine); `set_tpu_launch_env` never overwrites a variable set before it
runs, so that is a launch TorchTPU accepts as it is.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping

from tpurec.planner.topology import SliceSpec
from tpurec.runtime.tpu_vm import cloud_tpu_host_env

BASE_PORT = 8070  # TORCH_TPU_BASE_PORT's default (torch_tpu/_internal/distributed/distributed.py)
MASTER_PORT = "29500"  # set_tpu_launch_env's MASTER_PORT on several hosts

# TORCH_TPU_TOPOLOGY of one host, by the devices attached to it: torch_tpu/_internal/utils/hardware.py
# (_V4_TOPOLOGY, _V5P_TOPOLOGY, ...; `get_tpu_topology()` looks the PCI count up there, and raises
# "No TPU topology found for count: N" for any other count). v5e: the Cloud TPU VM (OSS) entry.
HOST_TOPOLOGY: dict[str, dict[int, str]] = {
    "v4": {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"},
    "v5e": {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"},
    "v5p": {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"},
    "v6e": {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"},
    "v7x": {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"},
}


def host_address(host: int) -> str:
    """The loopback address standing for emulated host `host` (127.0.0.0/8 is all loopback)."""
    return f"127.0.0.{host + 1}"


def host_topology(generation: str, devices: int) -> str:
    """TORCH_TPU_TOPOLOGY as TorchTPU detects it on a host with `devices` devices: this host's mesh only."""
    try:
        return HOST_TOPOLOGY[generation][devices]
    except KeyError:
        raise RuntimeError(f"No TPU topology found for count: {devices}") from None  # hardware.py's words


def physical_topology(spec: SliceSpec) -> str:
    """The whole slice's chips as a mesh ("2,2,2" for v5p-16, "4,4" for v6e-16): a `TORCH_TPU_TOPOLOGY`
    an operator may set from the outside (then TorchTPU ranks hosts by their chips' coordinates in it);
    TorchTPU itself only ever sets the host-local one (`host_topology`).

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


def set_tpu_launch_env_rules(
    environ: Mapping[str, str],
    *,
    nnodes: int | None,
    nproc_per_node: int | None,
    devices: int,
    generation: str,
    unused_port: Callable[[], int] = _unused_port,
) -> dict[str, str]:
    """The variables torch-tpu 0.2.0's `set_tpu_launch_env(nnodes=, nproc_per_node=)` sets on a host
    whose environment is `environ` and which has `devices` TPU devices of `generation` on PCI.

    Its rules (`torch_tpu/_internal/distributed/distributed.py`): a variable already set is never
    overwritten; `TORCH_TPU_XPROF_SESSION_ID` is this host's `time.time_ns()`. Several hosts (`nnodes >
    1`, two or more `TPU_WORKER_HOSTNAMES`, or `JOB_COMPLETION_INDEX` set): addresses
    `<host>:<TORCH_TPU_BASE_PORT (8070) + i>` for every host and `i` below `TORCH_TPU_DEVICES_PER_HOST`
    (default `nproc_per_node`, else the attached devices, else 8), `NNODES`, `NODE_RANK` (from the
    chips' coordinates in a slice-wide `TORCH_TPU_TOPOLOGY` set from the outside, else
    `JOB_COMPLETION_INDEX`, else ValueError), `MASTER_ADDR` (first worker), `MASTER_PORT` (29500) and
    the host-local `TORCH_TPU_TOPOLOGY`. One host: `localhost:<unused port>` per rank and the topology
    of `nproc_per_node` (or all attached) devices. `TORCH_TPU_DEVICES_PER_HOST` is read, never set.
    An emulated host has no chip coordinates, so its `NODE_RANK` always comes from `JOB_COMPLETION_INDEX`.
    """
    env = dict(environ)

    def once(name: str, factory: Callable[[], str]) -> None:
        if name not in env:
            env[name] = factory()

    once("TORCH_TPU_XPROF_SESSION_ID", lambda: str(time.time_ns()))
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if nnodes is not None and hosts and nnodes != len(hosts):
        raise ValueError(
            "set_tpu_launch_env(): expected nnodes to match the number of hosts in environment variable "
            f'TPU_WORKER_HOSTNAMES ({len(hosts)}: "{env["TPU_WORKER_HOSTNAMES"]}"), got {nnodes}'
        )
    completion_index = env.get("JOB_COMPLETION_INDEX")
    if (nnodes is not None and nnodes > 1) or len(hosts) > 1 or completion_index is not None:

        def worker_hostnames() -> list[str]:
            if not hosts:
                raise ValueError(
                    "set_tpu_launch_env(): expected environment variable TPU_WORKER_HOSTNAMES to be a "
                    "comma-separated list of worker hostnames or IP addresses, got it as unset"
                )
            return hosts

        def addresses() -> str:
            base = int(env.get("TORCH_TPU_BASE_PORT", BASE_PORT))
            per_host = int(env.get("TORCH_TPU_DEVICES_PER_HOST") or (nproc_per_node or devices or 8))
            return ",".join(f"{h}:{base + i}" for h in worker_hostnames() for i in range(per_host))

        def node_rank() -> str:
            if completion_index is None:
                raise ValueError(
                    "set_tpu_launch_env(): expected either TPU device coordinates together with environment "
                    "variable TORCH_TPU_TOPOLOGY, or environment variable JOB_COMPLETION_INDEX to be a "
                    "0-based index of this host (Kubernetes Indexed Jobs set this automatically), to "
                    "determine NODE_RANK, got neither"
                )
            return str(int(completion_index))

        once("TORCH_TPU_SLICEBUILDER_ADDRESSES", addresses)
        once("NNODES", lambda: str(nnodes if nnodes is not None else len(worker_hostnames())))
        once("NODE_RANK", node_rank)
        once("MASTER_ADDR", lambda: worker_hostnames()[0])
        once("MASTER_PORT", lambda: MASTER_PORT)
        if devices:
            once("TORCH_TPU_TOPOLOGY", lambda: host_topology(generation, devices))
    else:
        count = nproc_per_node if nproc_per_node is not None else devices

        def topology() -> str:
            if not devices:
                raise ValueError("set_tpu_launch_env(): expected TPU devices, got none")
            return host_topology(generation, count)

        once("TORCH_TPU_SLICEBUILDER_ADDRESSES", lambda: ",".join(f"localhost:{unused_port()}" for _ in range(count)))
        once("TORCH_TPU_TOPOLOGY", topology)
    return {k: v for k, v in env.items() if environ.get(k) != v}


def emulated_metadata(spec: SliceSpec, host: int) -> Callable[[str], str | None]:
    """What the metadata server of emulated host `host` of `spec` answers (a Cloud TPU VM's
    `agent-worker-number` and `worker-network-endpoints`), the workers being loopback addresses."""
    values = {
        "agent-worker-number": str(host),
        "worker-network-endpoints": ",".join(host_address(h) for h in range(spec.hosts)),
    }
    return values.get


def emulated_launch_env(
    spec: SliceSpec, session: str | None = None, master_port: str | None = None
) -> list[dict[str, str]]:
    """One environment per host of `spec`: what the TPU VM gives it and what set_tpu_launch_env() then
    sets there. `session` pins TORCH_TPU_XPROF_SESSION_ID on every host (by default each host picks its
    own, as TorchTPU does); on several hosts MASTER_PORT is pinned to `master_port` (default: an unused
    port of this machine, shared by the hosts)."""
    outside = {} if session is None else {"TORCH_TPU_XPROF_SESSION_ID": session}
    if spec.hosts > 1:
        outside["MASTER_PORT"] = master_port or str(_unused_port())
    envs = []
    for host in range(spec.hosts):
        given = dict(outside, **cloud_tpu_host_env(spec.hosts, outside, emulated_metadata(spec, host)))
        launch = set_tpu_launch_env_rules(
            given,
            nnodes=spec.hosts,
            nproc_per_node=None,
            devices=spec.devices_per_host,
            generation=spec.generation.name,
        )
        envs.append(dict(given, **launch))
    return envs
