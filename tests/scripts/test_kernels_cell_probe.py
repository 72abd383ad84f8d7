"""scripts/kernels_cell_probe.py: matrix cells in sequence, one JSON line each, on the tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cells_run_in_order_with_their_ratio_and_huge_pages():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "scripts/kernels_cell_probe.py", "sgd/1/small", "adagrad/var/hot", "--quick", "--rounds", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [c["cell"] for c in lines] == ["sgd/1/small", "adagrad/var/hot"]
    for c in lines:
        assert c["ratio_vs_fbgemm"] > 0 and len(c["round_ratios"]) == 2 and len(c["first_in_round"]) == 2
        assert c["tpurec_step_ms"] > 0 and c["peer_step_ms"] > 0
        assert c["huge_pages_mb"] >= 0 if sys.platform.startswith("linux") else c["huge_pages_mb"] == -1
