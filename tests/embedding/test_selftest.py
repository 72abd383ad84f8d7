"""`tpurec selftest` runs end to end."""

import json
import subprocess
import sys

from tpurec.embedding import selftest


def test_cpu_selftest_passes_every_check():
    checks = selftest.cpu_checks(seed=1)
    names = [c.name for c in checks]
    assert any("FBGEMM" in n and "rowwise_adagrad" in n for n in names)
    assert any("adam" in n for n in names) and any("forward mean" in n for n in names)
    failed = [c for c in checks if not c.passed]
    assert not failed, failed
    assert all(c.max_error <= c.tolerance for c in checks)


def test_selftest_cli_json_and_tpu_refusal():
    out = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "selftest", "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cpu" and doc["passed"] and len(doc["checks"]) >= 8
    from tpurec.runtime.device import tpu_status

    if not tpu_status().usable:
        out = subprocess.run(
            [sys.executable, "-m", "tpurec.cli", "selftest", "--device", "tpu"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and "cannot run TPU kernels" in out.stdout
