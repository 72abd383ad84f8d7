"""`tpurec bench track`: tpurec's DMP and stock TorchRec's train to the same losses, step by step
(issue #40 item 7: the direct CPU step sums and rounds as FBGEMM's CPU TBE does)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _track(tmp_path, *args: str) -> dict:
    env = dict(os.environ, TPUREC_CACHE=str(tmp_path), PYTHONPATH=str(REPO))
    env.pop("TPUREC_NO_DIRECT", None)
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "bench", "track", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.slow  # 20 s, make test-all: stock's bit-equal losses stay in the fast suite through the sharding harness
@pytest.mark.multiprocess
def test_dlrm_tiny_losses_equal_stock_torchrec_at_every_step(tmp_path):
    r = _track(tmp_path, "--tables", "tiny", "--steps", "40", "--eval-batches", "4")
    assert r["tpurec_path"] == "direct" and len(r["losses"]["tpurec"]) == 40
    # bit for bit, not within a tolerance: one last-bit difference grows under Adagrad
    assert r["losses"]["tpurec"] == r["losses"]["torchrec"], r["first_step_differing"]
    assert r["max_loss_difference"] == 0.0 and r["first_step_differing"] is None
    assert r["auc"]["tpurec"] == r["auc"]["torchrec"] and 0.5 < r["auc"]["tpurec"] < 1.0
    assert r["losses"]["tpurec"][-1] < r["losses"]["tpurec"][0]  # it trained


@pytest.mark.slow  # ~4 min: 2 x 200 steps of DLRM-DCNv2 at 2 ranks, and the layout path's run
@pytest.mark.multiprocess
def test_kaggle_100k_dcn_tracks_stock_at_two_ranks_and_the_layout_path_does_not(tmp_path):
    r = _track(tmp_path, "--nproc", "2")
    assert r["steps"] == 200 and r["losses_within_tolerance"] and r["auc_equal_to_3_decimals"]
    assert r["max_loss_difference"] == 0.0
    layout = _track(tmp_path, "--nproc", "2", "--layout")  # the TPU's summation order
    assert layout["tpurec_path"] == "layout" and layout["max_loss_difference"] > 0.0
