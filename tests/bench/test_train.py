"""`tpurec bench train --json`: both sides run on 2 ranks and the JSON has the documented keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_train_json(tmp_path):
    env = dict(os.environ, TPUREC_CACHE=str(tmp_path), PYTHONPATH=str(REPO))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpurec.cli",
            "bench",
            "train",
            "--json",
            "--steps",
            "20",
            "--warmup",
            "3",
            "--repeats",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert {"tpurec_samples_per_s", "torchrec_samples_per_s", "ratio_vs_torchrec"} <= set(r)
    assert r["tpurec_samples_per_s"] > 0 and r["torchrec_samples_per_s"] > 0
    assert r["ratio_vs_torchrec"] == pytest.approx(r["tpurec_samples_per_s"] / r["torchrec_samples_per_s"], rel=1e-2)
    assert len(r["rounds"]) == 1 and r["rounds"][0]["ratio_vs_torchrec"] == r["ratio_vs_torchrec"]
    assert len(r["load_average_1min"]) == 2
    assert r["torchrec_plan"] == "26 table_wise/fused" and "customized_kernel" in r["tpurec_plan"]
