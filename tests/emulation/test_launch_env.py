"""The emulated launch environment follows TorchTPU's set_tpu_launch_env() rules; hosts as Cloud TPU has them."""

from __future__ import annotations

import pytest

from tpurec.emulation.launch_env import emulated_launch_env, physical_topology, set_tpu_launch_env_rules
from tpurec.planner.topology import make_topology, parse_slice


def _hosts(n: int) -> str:
    return ",".join(f"127.0.0.{h + 1}" for h in range(n))


def _addresses(n: int, per_host: int = 4) -> str:
    return ",".join(f"127.0.0.{h + 1}:{8070 + i}" for h in range(n) for i in range(per_host))


# Each host's environment as torch-tpu 0.2.0's own set_tpu_launch_env(nnodes=H) leaves it, observed in the
# TorchTPU venv (tests/emulation/test_torchtpu_launch_env.py, 2026-12-03) on a host with 4 chips on PCI,
# given JOB_COMPLETION_INDEX and TPU_WORKER_HOSTNAMES as a Cloud TPU VM's metadata gives them
# (tpurec.runtime.tpu_vm.cloud_tpu_host_env) and TORCH_TPU_XPROF_SESSION_ID=42. TORCH_TPU_TOPOLOGY is the host's
# own 2x2x1 (hardware.py), never the slice's; TORCH_TPU_DEVICES_PER_HOST is never set. MASTER_PORT
# (29500 there) is left out: the emulation pins an unused port.
OBSERVED = {
    "v5p-16": [
        {
            "TPU_WORKER_HOSTNAMES": _hosts(2),
            "JOB_COMPLETION_INDEX": str(h),
            "TORCH_TPU_XPROF_SESSION_ID": "42",
            "TORCH_TPU_SLICEBUILDER_ADDRESSES": _addresses(2),
            "NNODES": "2",
            "NODE_RANK": str(h),
            "MASTER_ADDR": "127.0.0.1",
            "TORCH_TPU_TOPOLOGY": "2,2,1",
        }
        for h in range(2)
    ],
    "v6e-16": [
        {
            "TPU_WORKER_HOSTNAMES": _hosts(4),
            "JOB_COMPLETION_INDEX": str(h),
            "TORCH_TPU_XPROF_SESSION_ID": "42",
            "TORCH_TPU_SLICEBUILDER_ADDRESSES": _addresses(4),
            "NNODES": "4",
            "NODE_RANK": str(h),
            "MASTER_ADDR": "127.0.0.1",
            "TORCH_TPU_TOPOLOGY": "2,2,1",
        }
        for h in range(4)
    ],
}


@pytest.mark.parametrize("name", sorted(OBSERVED))
def test_each_host_of_a_slice_gets_what_torchtpu_sets_there(name):
    hosts = emulated_launch_env(parse_slice(name), session="42")
    ports = {h.pop("MASTER_PORT") for h in hosts}
    assert hosts == OBSERVED[name]
    assert len(ports) == 1 and ports.pop().isdigit()  # one port, pinned on every host


def test_each_host_picks_its_own_xprof_session_unless_one_is_given():
    # set_tpu_launch_env: TORCH_TPU_XPROF_SESSION_ID is the host's time.time_ns() when unset.
    hosts = emulated_launch_env(parse_slice("v5p-16"))
    assert all(h["TORCH_TPU_XPROF_SESSION_ID"].isdigit() for h in hosts)


def test_one_host_gets_one_localhost_address_per_rank_and_no_rendezvous():
    # Observed on a v5p-8 host: the session, 4 x localhost:<unused port>, the topology; nothing else.
    (host,) = emulated_launch_env(parse_slice("v5p-8"), session="42")
    addresses = host.pop("TORCH_TPU_SLICEBUILDER_ADDRESSES").split(",")
    assert len(addresses) == 4 and all(a.startswith("localhost:") and a[10:].isdigit() for a in addresses)
    assert host == {"TORCH_TPU_XPROF_SESSION_ID": "42", "TORCH_TPU_TOPOLOGY": "2,2,1"}
    (host,) = emulated_launch_env(parse_slice("v6e-8"), session="42")
    assert host["TORCH_TPU_TOPOLOGY"] == "2,4,1"  # hardware.py's _V6E_TOPOLOGY[8]


def test_the_rules_refuse_what_torchtpu_refuses():
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX to be a 0-based index"):
        set_tpu_launch_env_rules(
            {"TPU_WORKER_HOSTNAMES": "a,b"}, nnodes=2, nproc_per_node=None, devices=4, generation="v5p"
        )
    with pytest.raises(ValueError, match="TPU_WORKER_HOSTNAMES to be a comma-separated"):
        set_tpu_launch_env_rules(
            {"JOB_COMPLETION_INDEX": "1"}, nnodes=2, nproc_per_node=None, devices=4, generation="v5p"
        )
    with pytest.raises(ValueError, match="expected nnodes to match"):
        set_tpu_launch_env_rules(
            {"TPU_WORKER_HOSTNAMES": "a,b"}, nnodes=3, nproc_per_node=None, devices=4, generation="v5p"
        )
    # Never overwrites what is set; TORCH_TPU_DEVICES_PER_HOST is read, not set.
    given = {
        "TPU_WORKER_HOSTNAMES": "a,b",
        "JOB_COMPLETION_INDEX": "1",
        "MASTER_PORT": "1234",
        "TORCH_TPU_DEVICES_PER_HOST": "2",
    }
    out = set_tpu_launch_env_rules(given, nnodes=2, nproc_per_node=None, devices=4, generation="v5p")
    assert "MASTER_PORT" not in out and "TORCH_TPU_DEVICES_PER_HOST" not in out
    assert out["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "a:8070,a:8071,b:8070,b:8071"


@pytest.mark.parametrize(
    "name, mesh",
    [("v5p-8", "2,2,1"), ("v5p-32", "2,2,4"), ("v5p-128", "4,4,4"), ("v6e-16", "4,4"), ("v7x-16", "2,2,4")],
)
def test_physical_topology_matches_cloud_tpu_shapes(name, mesh):
    assert physical_topology(parse_slice(name)) == mesh


@pytest.mark.parametrize(
    "name, hosts, per_host", [("v6e-8", 1, 8), ("v6e-16", 4, 4), ("v6e-256", 64, 4), ("v5p-16", 2, 4)]
)
def test_multi_host_v6e_runs_on_four_chip_vms(name, hosts, per_host):
    spec = parse_slice(name)
    assert (spec.hosts, spec.devices_per_host) == (hosts, per_host)
    # TorchRec's runtime LOCAL_WORLD_SIZE must equal the plan's host size (TWRW, comm costs).
    assert make_topology(name, compute_device="tpu").local_world_size == per_host


def test_a_slice_too_big_for_this_machine_is_refused_at_once(tmp_path):
    import os
    import subprocess
    import sys

    from tests.dlrm.helpers import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO), TPUREC_HOST_MEMORY_BYTES=str(6 << 30))  # room for 6 ranks
    for cmd in (["train", "--emulate-tpu", "v5p-16"], ["launch", "--emulate-tpu", "v5p-16", __file__]):
        p = subprocess.run([sys.executable, "-m", "tpurec.cli", *cmd], env=env, capture_output=True, text=True)
        assert p.returncode == 2
        assert "v5p-16 has 8 ranks, ~8 GiB" in p.stderr and "room for about 6 ranks" in p.stderr
