"""Launching ranks on a slice: TorchTPU's launch environment first, one agent per host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.dlrm.helpers import REPO

# Stands in for torch_tpu's `torch.tpu.distributed` in the child that tpurec asks for the launch
# environment: records its arguments and decides the variables as set_tpu_launch_env() does on a host
# with 4 chips (torch_tpu/_internal/distributed/distributed.py; NODE_RANK from JOB_COMPLETION_INDEX, a
# KeyError where TorchTPU raises ValueError).
FAKE_TORCH_TPU = textwrap.dedent("""
    import os, sys, types
    dist = types.ModuleType("torch.tpu.distributed")
    def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):
        os.environ.setdefault("TORCH_TPU_XPROF_SESSION_ID", "7")
        hosts = os.environ["TPU_WORKER_HOSTNAMES"].split(",")
        per_host = nproc_per_node or 4
        os.environ.setdefault(
            "TORCH_TPU_SLICEBUILDER_ADDRESSES", ",".join(f"{h}:{8070 + i}" for h in hosts for i in range(per_host))
        )
        os.environ.setdefault("NNODES", str(nnodes))
        os.environ.setdefault("NODE_RANK", os.environ["JOB_COMPLETION_INDEX"])
        os.environ.setdefault("MASTER_ADDR", hosts[0])
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("TORCH_TPU_TOPOLOGY", "2,2,1")
        os.environ["FAKE_CALLED_WITH"] = f"{nnodes},{nproc_per_node}"
    dist.set_tpu_launch_env = set_tpu_launch_env
    tpu = types.ModuleType("torch.tpu")
    tpu.distributed = dist
    sys.modules["torch.tpu"] = tpu
    sys.modules["torch.tpu.distributed"] = dist
""")


def _fake_torch_tpu(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(FAKE_TORCH_TPU)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_a_tpu_hosts_agent_gets_torchtpus_launch_env_and_its_node_rank(tmp_path, monkeypatch):
    from tpurec.dlrm.cli import RANK_PROGRAM
    from tpurec.launch import hosts

    _fake_torch_tpu(tmp_path, monkeypatch)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.5,10.0.0.6")
    monkeypatch.setenv("TPU_WORKER_ID", "1")  # as GKE sets them
    cmd, env = hosts.tpu_agent(None, 2, {"X": "1"}, RANK_PROGRAM)
    assert env["X"] == "1" and env["JOB_COMPLETION_INDEX"] == "1" and env["NODE_RANK"] == "1"
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1" and "TORCH_TPU_DEVICES_PER_HOST" not in env
    assert len(env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 8
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--nproc-per-node=4" in cmd
    assert "--master-addr=10.0.0.5" in cmd and "--master-port=29500" in cmd
    assert cmd[-2:] == ["-m", "tpurec.dlrm"]


def test_a_cloud_tpu_vm_host_takes_its_index_and_the_hosts_from_the_metadata_server(tmp_path, monkeypatch):
    from tpurec.launch import hosts
    from tpurec.runtime import tpu_vm

    _fake_torch_tpu(tmp_path, monkeypatch)
    # A Cloud TPU VM sets no TPU_WORKER_* variable; its metadata server has them (JAX reads the same
    # attributes: jax/_src/clusters/cloud_tpu_cluster.py). Older endpoints are name:id:ip triples.
    answers = {"agent-worker-number": "1", "worker-network-endpoints": "w-0:0:10.0.0.5,w-1:1:10.0.0.6"}
    monkeypatch.setattr(tpu_vm, "gce_metadata", answers.get)
    cmd, env = hosts.tpu_agent(None, 2, {}, ["prog.py"])
    assert env["TPU_WORKER_HOSTNAMES"] == "10.0.0.5,10.0.0.6" and env["JOB_COMPLETION_INDEX"] == "1"
    assert "--node-rank=1" in cmd and "--master-addr=10.0.0.5" in cmd
    # One host: nothing from the metadata (JOB_COMPLETION_INDEX would put TorchTPU on its multi-host path).
    assert tpu_vm.cloud_tpu_host_env(1, {}, answers.get) == {}


def test_a_host_that_cannot_tell_its_index_is_refused_with_the_fix(monkeypatch):
    from tpurec.errors import UserError
    from tpurec.runtime import tpu_vm

    monkeypatch.setattr(tpu_vm, "gce_metadata", {}.get)
    with pytest.raises(UserError, match="TPU_WORKER_HOSTNAMES is unset"):
        tpu_vm.cloud_tpu_host_env(2, {})
    with pytest.raises(UserError, match="set TPU_WORKER_ID"):
        tpu_vm.cloud_tpu_host_env(2, {"TPU_WORKER_HOSTNAMES": "a,b"})
    assert tpu_vm.cloud_tpu_host_env(2, {"TPU_WORKER_HOSTNAMES": "a,b", "NODE_RANK": "1"}) == {}
    # Set variables win over the metadata; GKE's TPU_WORKER_ID becomes JOB_COMPLETION_INDEX.
    assert tpu_vm.cloud_tpu_host_env(2, {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1"}) == {
        "JOB_COMPLETION_INDEX": "1"
    }


def test_a_failing_set_tpu_launch_env_is_one_line(tmp_path, monkeypatch):
    from tpurec.launch import hosts

    _fake_torch_tpu(tmp_path, monkeypatch)  # no TPU_WORKER_HOSTNAMES: the fake then fails, as TorchTPU would
    with pytest.raises(ValueError, match="set_tpu_launch_env\\(\\) failed on this host: KeyError"):
        hosts.tpu_agent(None, 1, {}, ["prog.py"])


PROBE = textwrap.dedent("""
    import json, os, sys
    import tpurec  # an emulated rank: TorchTPU's stand-ins go in here
    import torch, torch.distributed as dist
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    # One file per rank: 8 processes of 2 agents share one stdout, and their lines can interleave.
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "host": int(os.environ["GROUP_RANK"]),
        "local": int(os.environ["LOCAL_RANK"]),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "tpu_available_to_torchrec": __import__("torchrec").distributed.utils.get_device_type() == "tpu",
        }, f)
    dist.destroy_process_group()
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "slice_name, hosts, per_host",
    # Slow: 8 and 16 Python processes; the agents' commands are checked in the default suite below.
    [pytest.param("v5p-16", 2, 4, marks=pytest.mark.slow), pytest.param("v6e-16", 4, 4, marks=pytest.mark.slow)],
)
def test_tpurec_launch_groups_an_emulated_slices_ranks_into_its_hosts(tmp_path, slice_name, hosts, per_host):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", slice_name, str(probe), str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    world = hosts * per_host
    assert [r["rank"] for r in ranks] == list(range(world))
    # Ranks numbered host by host, as torchrun numbers them; LOCAL_WORLD_SIZE is the host's chips.
    assert [(r["host"], r["local"]) for r in ranks] == [(h, i) for h in range(hosts) for i in range(per_host)]
    assert {r["local_world"] for r in ranks} == {per_host} and {r["world"] for r in ranks} == {world}
    assert all(r["tpu_available_to_torchrec"] for r in ranks)


def test_an_emulated_slice_gets_one_agent_per_host_with_its_node_rank():
    from tpurec.launch.hosts import emulated_agents

    agents = emulated_agents("v6e-16", {"X": "1"}, ["prog.py", "--flag"])
    assert len(agents) == 4  # 4-chip VMs
    for host, (cmd, env) in enumerate(agents):
        assert f"--node-rank={host}" in cmd and "--nnodes=4" in cmd and "--nproc-per-node=4" in cmd
        assert "--master-addr=127.0.0.1" in cmd and cmd[-2:] == ["prog.py", "--flag"]
        assert env["X"] == "1" and env["TPUREC_EMULATE_TPU"] == "v6e-16" and env["NODE_RANK"] == str(host)
        assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16" and "TORCH_TPU_DEVICES_PER_HOST" not in env
        assert env["JOB_COMPLETION_INDEX"] == str(host) and env["TORCH_TPU_TOPOLOGY"] == "2,2,1"
    assert len({env["MASTER_PORT"] for _, env in agents}) == 1
