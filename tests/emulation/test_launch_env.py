"""The emulated launch environment follows TorchTPU's set_tpu_launch_env() rules; hosts as Cloud TPU has them."""

from __future__ import annotations

import pytest

from tpurec.emulation.launch_env import emulated_launch_env, physical_topology
from tpurec.planner.topology import make_topology, parse_slice


def test_two_hosts_of_v5p_16_agree_on_everything_but_their_rank():
    hosts = emulated_launch_env(parse_slice("v5p-16"), session="42")
    assert [h["NODE_RANK"] for h in hosts] == ["0", "1"]
    for key in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID", "MASTER_PORT"):
        assert hosts[0][key] == hosts[1][key], key
    addresses = hosts[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    # One host:port per rank, <host>:<8070 + i> per device of each host (set_tpu_launch_env's rule).
    assert addresses == [f"127.0.0.{h}:{8070 + i}" for h in (1, 2) for i in range(4)]
    assert hosts[0]["MASTER_ADDR"] == "127.0.0.1" and hosts[0]["NNODES"] == "2"
    assert hosts[0]["TORCH_TPU_TOPOLOGY"] == "2,2,2" and hosts[0]["TORCH_TPU_DEVICES_PER_HOST"] == "4"


def test_one_host_gets_one_localhost_address_per_rank_and_no_rendezvous():
    (host,) = emulated_launch_env(parse_slice("v5p-8"))
    assert len(host["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 4
    assert all(a.startswith("localhost:") for a in host["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(","))
    assert "NODE_RANK" not in host and "MASTER_ADDR" not in host


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
