"""`tpurec selftest --device tpu`'s first-contact checklist, run on CPU through the TorchTPU stand-in.

On CPU both sides of each comparison reach the stand-in (its kernels are the reference's), so this
shows that the checklist itself runs end to end, that it takes the SparseCore count from the chip
(the stand-in's), counts the programs TorchTPU is asked to compile, and steps a one-rank DMP; the
numeric checks of the adapter are in tests/embedding/test_tpu_adapter_on_standin.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from dataclasses import asdict
    from tpurec.emulation import torchtpu_ops as tpu_standin
    from tpurec.selftest.tpu import tpu_checks

    tpu_standin.install(sparsecores=int(sys.argv[3]))
    with tpu_standin.adapter_on_cpu():
        checks = tpu_checks("cpu", generation=sys.argv[2])
    print("RESULT", json.dumps([asdict(c) for c in checks]))
""")


def _run(generation: str, sparsecores: int) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO), generation, str(sparsecores)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][0]
    return json.loads(line[len("RESULT ") :])


def test_first_contact_checklist_passes_through_the_standin():
    checks = {c["name"]: c for c in _run("v6e", 2)}
    failed = [c for c in checks.values() if not c["passed"]]
    assert not failed, failed
    assert checks["chip and SparseCores"]["note"] == "TPU v6e: 2 SparseCores per device"
    programs = checks["programs compiled over 3 adam steps"]
    assert programs["max_error"] == programs["tolerance"] == 4.0  # 2 stacks x (lookup + update)
    assert "tables updated: True" in checks["1-rank DMP step"]["note"]
    assert {"module forward, host KJT", "module forward, device KJT", "forward sparse_dense_matmul"} <= set(checks)


PLANNED = {"hbm_used_bytes": 9000, "transient_bytes": 3000, "reserved_bytes": 1000}
TABLES = 2500


def test_memory_check_bounds_held_and_peak_bytes_by_the_planner():
    from tpurec.selftest.tpu import MEMORY_SLACK_BYTES, memory_check

    # steady figure: 9000 - 3000 transient - 1000 reserved = 5000; with the transient: 8000
    ok = memory_check(4000, 7000, PLANNED, TABLES)
    assert ok.passed and ok.tolerance == 5000 and "planned 8,000 B with the transient" in ok.note
    assert not memory_check(2000, None, PLANNED, TABLES).passed  # less than the tables: not on the device
    assert not memory_check(5000 + MEMORY_SLACK_BYTES + 1, None, PLANNED, TABLES).passed  # more than planned
    assert not memory_check(
        4000, 8000 + MEMORY_SLACK_BYTES + 1, PLANNED, TABLES
    ).passed  # peak above the transient budget
    assert (
        memory_check(4000, None, PLANNED, TABLES).passed and "no peak" in memory_check(4000, None, PLANNED, TABLES).note
    )
    # a peak beyond the device's capacity is no reading (TorchTPU 0.2.0 on the v5e chip: 1.4e14 B)
    with_cap = PLANNED | {"hbm_capacity_bytes": 16 * 2**30}
    bogus = memory_check(4000, 139_425_698_638_152, with_cap, TABLES)
    assert bogus.passed and "more than the device holds (17,179,869,184 B): not read" in bogus.note
    assert not memory_check(4000, 8000 + MEMORY_SLACK_BYTES + 1, with_cap, TABLES).passed  # a real peak still counts


ALLOCATOR_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from dataclasses import asdict
    from tpurec.emulation import torchtpu_ops as tpu_standin
    import tpurec.selftest.tpu as T

    # An allocator that reports what the DMP's tables really hold: 0 before, after the step the
    # bytes of the kernels created since (the earlier checks' modules may still be alive).
    import gc
    from tpurec.embedding.kernel import SparseCoreKernel
    earlier = set()
    def fake_device_bytes(target):
        kernels = [o for o in gc.get_objects() if isinstance(o, SparseCoreKernel)]
        if not earlier:
            earlier.update(id(k) for k in kernels)
            earlier.add(None)
            return 0
        held = sum(b.numel() * b.element_size() for k in kernels if id(k) not in earlier for b in k.buffers())
        print("HELD", held)
        return held
    T._device_bytes = fake_device_bytes
    tpu_standin.install(sparsecores=2)
    with tpu_standin.adapter_on_cpu():
        checks = T.tpu_checks("cpu", generation="v6e")
    print("RESULT", json.dumps([asdict(c) for c in checks]))
""")


def test_checklist_compares_device_memory_with_the_planners_figure():
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_SCRIPT, str(REPO)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][0]
    check = {c["name"]: c for c in json.loads(line[len("RESULT ") :])}["device memory vs planner"]
    held = int([x for x in out.stdout.splitlines() if x.startswith("HELD ")][-1].split()[1])
    # the kernels' storage reached the check, and fits in the planner's figure for the same plan
    assert check["passed"], check
    assert check["max_error"] == held >= (500 * 16 + 300 * 8) * 4  # tables a (500 x 16), b (300 x 8) in fp32
    assert check["tolerance"] >= held


@pytest.mark.parametrize(
    ("slice_name", "chip"),
    [
        # v6e-16 in make test-all (default suite time: 4 s here): v5e-1 keeps the CLI's emulated path, and
        # test_first_contact_checklist_passes_through_the_standin the v6e chip's checks
        pytest.param("v6e-16", "TPU v6e: 2 SparseCores per device", marks=pytest.mark.slow),
        # no SparseCore: the TensorCore kernel's TPU kernels through the JAX-bridge stand-in
        ("v5e-1", "TPU v5e: no SparseCore; the TensorCore kernel, a layout of 1 per device"),
    ],
)
def test_selftest_on_an_emulated_slice_passes_through_torchtpus_stand_ins(slice_name, chip):
    env = dict(__import__("os").environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "selftest", "--emulate-tpu", slice_name, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(out.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["passed"] and doc["device"] == f"tpu (emulated {slice_name})"
    assert checks["chip and SparseCores"]["note"] == chip
    assert "cpu:gloo,tpu:tpu_dist" in checks["1-rank DMP step"]["note"]
    programs = checks["programs compiled over 3 adam steps"]
    assert programs["max_error"] == programs["tolerance"] == 4.0  # 2 stacks x (lookup + update)
