"""`tpurec bench plan --json`: both planners run on the same model and world size; the document's
shape. No wall-clock assertion: the host is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(*argv) -> subprocess.CompletedProcess:
    # In a child process, as a user runs it: planning for "tpu" names torch's PrivateUse1 backend
    # for the rest of the process (harmless since the offline torch.tpu module, but process-wide).
    return subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "bench", "plan", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


def test_bench_plan_json_times_both_planners():
    p = _bench("--json", "--model", "dlrm-tiny", "--topology", "v5p-8", "--repeats", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["model"], r["topology"], r["world_size"], r["repeats"]) == ("dlrm-tiny", "v5p-8", 4, 2)
    assert r["torchrec_topology"].startswith("cuda x 4")
    assert (r["batch_size_per_device"], r["optimizer"]) == (512, "rowwise_adagrad")  # dlrm-tiny's training config
    assert len(r["tpurec_runs_s"]) == len(r["torchrec_runs_s"]) == 2
    assert r["tpurec_s"] > 0 and r["torchrec_s"] > 0
    assert r["ratio_vs_torchrec"] == pytest.approx(r["torchrec_s"] / r["tpurec_s"], rel=0.01, abs=0.002)
    # both planners planned every table: tpurec onto its kernel, TorchRec onto FBGEMM's
    assert r["tpurec_plan"]["tables"] == r["torchrec_plan"]["tables"] == 26
    assert r["tpurec_plan"]["compute_kernels"] == ["customized_kernel"]
    assert r["torchrec_plan"]["compute_kernels"] != ["customized_kernel"]


def test_bench_plan_refuses_a_bad_slice_in_one_line():
    p = _bench("--topology", "v6e-3")
    assert p.returncode == 2 and "not a Cloud TPU v6e slice" in p.stderr and "Traceback" not in p.stderr
