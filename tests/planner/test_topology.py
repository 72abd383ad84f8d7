import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpurec.planner.topology import GB, GiB, make_topology, parse_slice

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name,gen,chips,devices,hosts,slices",
    [
        ("v5p-8", "v5p", 4, 4, 1, 1),  # v5p counts TensorCores: 8 cores = 4 chips
        ("v5p-128", "v5p", 64, 64, 16, 1),
        ("v6e-4", "v6e", 4, 4, 1, 1),  # sub-host slice
        ("v6e-256", "v6e", 256, 256, 64, 1),  # v6e counts chips; multi-host slices are 4-chip VMs
        ("v7x-64", "v7x", 64, 128, 16, 1),  # v7x counts chips, 2 devices per chip, 4 chips per host
        ("tpu7x-8", "v7x", 8, 16, 2, 1),
        ("v5litepod-16", "v5e", 16, 16, 2, 1),
        ("v5e-8", "v5e", 8, 8, 1, 1),
        ("v4-8", "v4", 4, 4, 1, 1),
        ("2xv5p-128", "v5p", 64, 128, 32, 2),  # multislice
        (" V6E-8 ", "v6e", 8, 8, 1, 1),
    ],
)
def test_parse_slice_forms(name, gen, chips, devices, hosts, slices):
    s = parse_slice(name)
    assert (s.generation.name, s.chips_per_slice, s.world_size, s.hosts, s.num_slices) == (
        gen,
        chips,
        devices,
        hosts,
        slices,
    )


@pytest.mark.parametrize(
    "bad,why",
    [
        ("v5p-7", "even"),
        ("v9-8", "unknown TPU generation"),
        ("v5p128", "malformed"),
        ("v6e-12", "not a Cloud TPU v6e slice"),
        ("v5p-0", "positive"),
        ("", "malformed"),
    ],
)
def test_bad_slice_names_list_valid_forms(bad, why):
    with pytest.raises(ValueError, match=why):
        parse_slice(bad)
    with pytest.raises(ValueError) as e:
        parse_slice("x")
    assert "v5p-N" in str(e.value) and "v7x-N" in str(e.value)


def test_catalog_values_per_device():
    v5p, v6e, v7x = (parse_slice(n).generation for n in ("v5p-8", "v6e-8", "v7x-8"))
    assert (v5p.hbm_bytes, v5p.sparsecores, v5p.hbm_bw) == (95 * GiB, 4, 2765 * GB)
    assert (v6e.hbm_bytes, v6e.sparsecores, v6e.chips_per_host) == (32 * GB, 2, 8)
    assert (v7x.hbm_bytes, v7x.sparsecores, v7x.devices_per_chip) == (96 * GiB, 2, 2)
    assert parse_slice("v5e-8").generation.sparsecores == 0 and parse_slice("v4-8").generation.sparsecores == 0


def test_make_topology_tpu_offline():
    t = make_topology("v5p-16")
    assert (t.world_size, t.compute_device, t.local_world_size) == (8, "tpu", 4)
    assert t.devices[3].storage.hbm == 95 * GiB
    assert t.hbm_mem_bw == pytest.approx(2765e9 / 1e3)  # torchrec wants bytes per ms
    assert t.comms_bandwidths.intra_host_bw == pytest.approx(1200e9 / 1e3)
    assert t.comms_bandwidths.inter_host_bw == pytest.approx(25e9 / 4 / 1e3)
    import torch

    assert torch.device("tpu:0").type == "tpu"  # offline planning needs the backend name


def test_make_topology_errors_and_generic():
    with pytest.raises(ValueError, match="world_size=4"):
        make_topology("v5p-16", 4)
    v5e = make_topology("v5e-8")  # planned for the TensorCore kernel (no SparseCores)
    assert (v5e.world_size, v5e.spec.generation.sparsecores, v5e.devices[0].storage.hbm) == (8, 0, 16 * 10**9)
    with pytest.raises(ValueError, match="needs world_size"):
        make_topology(None)
    cpu = make_topology(None, 2, "cpu")
    assert (cpu.world_size, cpu.devices[0].storage.hbm, cpu.devices[0].storage.ddr) == (2, 0, 64 * GiB)
    assert cpu.spec.generation.sparsecores == 4


def test_generic_tpu_topology_from_environment(monkeypatch):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    t = make_topology(None, 8, "tpu")
    assert t.spec.generation.name == "v6e" and t.devices[0].storage.hbm == 32 * GB
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    assert make_topology(None, 6, "tpu").spec.generation.name == "v5p"


def test_cpu_n_topology_string_for_dry_runs():
    from tpurec.planner.topology import make_topology

    t = make_topology("cpu-3", 3, "tpu")  # a CPU dry run whatever device the caller names
    assert t.world_size == 3 and t.compute_device == "cpu"
    with pytest.raises(ValueError, match="cpu-N"):
        make_topology("cpu-0")
    with pytest.raises(ValueError, match="world_size=4"):
        make_topology("cpu-2", 4)


def test_unnamed_tpu_topology_follows_the_host_chips(monkeypatch):
    from tpurec.planner.topology import make_topology
    from tpurec.runtime import device

    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setattr(device, "tpu_generation", lambda: "v6e")
    topo = make_topology(None, world_size=8, compute_device="tpu")
    assert topo.spec.generation.name == "v6e" and topo.spec.generation.sparsecores == 2


@pytest.mark.parametrize(
    "name,match",
    [
        (
            "v6e-3",
            "'v6e-3' is not a Cloud TPU v6e slice; valid sizes: v6e-1, v6e-4, v6e-8, v6e-16, v6e-32, v6e-64, "
            "v6e-128, v6e-256 (cloud.google.com/tpu/docs/v6e)",
        ),
        ("v5p-2", "not a Cloud TPU v5p slice; valid sizes: v5p-8, v5p-16, v5p-32, v5p-64, v5p-128"),
        ("v5p-8960", "'v5p-8960' is not a Cloud TPU v5p slice"),  # the pod is 8,960 chips, no slice is
        ("v5p-200", "not a Cloud TPU v5p slice"),  # 100 chips: whole host but no torus shape
        ("v7x-2", "valid sizes: v7x-4, v7x-8"),
        ("v5p-100000000", "50,000,000 chips, but a v5p slice is at most 6,144 chips; use several slices"),
        ("v6e-512", "at most 256 chips"),
        ("1000xv5p-8192", "4,096,000 chips in all; tpurec plans at most 65,536"),
    ],
)
def test_slices_that_cannot_exist_are_refused_at_once(name, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_slice(name)


@pytest.mark.parametrize(
    "name,chips",
    [("v5p-12288", 6144), ("v5p-32", 16), ("v5p-384", 192), ("v7x-9216", 9216), ("v6e-256", 256), ("v6e-1", 1)],
)
def test_pod_sized_and_single_chip_slices_parse(name, chips):
    assert parse_slice(name).chips_per_slice == chips


def test_cpu_training_still_works_after_planning_for_tpu():
    # Planning for "tpu" names torch's PrivateUse1 backend, which is process-wide, so this runs in
    # a fresh interpreter. Before the fix, torch.optim.Adam.step() then raised "Device 'tpu' does not
    # have a corresponding module registered as 'torch.tpu'" (a notebook planning for a TPU slice
    # and then training on CPU hit it).
    code = (
        "import torch\n"
        "from tpurec.planner.topology import make_topology\n"
        "make_topology('v5p-8')\n"
        "assert torch._C._get_privateuse1_backend_name() == 'tpu'\n"
        "m = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.Adam(m.parameters(), lr=0.5)\n"
        "before = m.weight.detach().clone()\n"
        "m(torch.ones(1, 2)).sum().backward()\n"
        "opt.step()\n"
        "assert not torch.equal(before, m.weight), 'Adam did not update'\n"
        "assert torch.tpu.is_available() is False and torch.tpu.device_count() == 0\n"
        "print('trained')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "trained"


def test_the_slice_a_rank_runs_on_names_its_unnamed_topology(monkeypatch):
    """DMP plans with make_topology(None, world_size): on a Cloud TPU VM (TPU_ACCELERATOR_TYPE) or an emulated
    rank (`tpurec launch --emulate-tpu v5p-16`) the topology is that slice, its name in the plan's header; it
    said `on v5px8dev` (issue 63 item 7). Another world size keeps the generic name."""
    from tpurec.runtime.device import EMULATE_ENV

    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv(EMULATE_ENV, "v5p-16")
    emulated = make_topology(None, 8, "tpu")
    assert (emulated.spec.name, emulated.spec.hosts, emulated.local_world_size) == ("v5p-16", 2, 4)
    assert make_topology(None, 4, "tpu").spec.name == "v5px4dev"
    monkeypatch.delenv(EMULATE_ENV)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    assert make_topology(None, 8, "tpu").spec.name == "v6e-8"
