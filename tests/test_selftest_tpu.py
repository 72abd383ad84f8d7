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

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from dataclasses import asdict
    from tests import tpu_standin
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


def test_a_chip_without_usable_sparsecores_fails_the_first_line():
    (check,) = _run("v5e", 2)
    assert not check["passed"] and "no SparseCore the embedding kernels can drive" in check["note"]
