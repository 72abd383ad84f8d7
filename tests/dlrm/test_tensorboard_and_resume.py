"""`--tensorboard DIR` and `--metrics-out` across a resume: TensorBoard's own reader loads the
scalars as docs/train.md names them, and a run resumed from an earlier checkpoint than its last
logged step leaves one metrics row per step and a curve that never loops back."""

from __future__ import annotations

import csv
import os

import pytest

from .helpers import train


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
def test_tensorboard_and_metrics_have_one_row_per_step_after_a_resume(cache, tmp_path):
    common = ["--synth-rows", 30000, "--eval-every", 2, "--keep", 0, "--checkpoint-dir", tmp_path / "ck"]
    outs = ["--metrics-out", tmp_path / "m.csv", "--tensorboard", tmp_path / "tb", "--curves-out", "none"]
    train("--steps", 6, "--checkpoint-every", 2, *common, *outs, cache=cache)
    first = _scalars(tmp_path / "tb")
    assert [s for s, _ in first["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in first["eval/auc"]] == [2, 4, 6]
    assert {"train/samples_per_s", "eval/ne", "eval/logloss", "eval/accuracy"} <= set(first)
    assert any(t.startswith("id_demand/") and t.endswith("/max_ids") for t in first)
    with open(tmp_path / "m.csv") as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]): float(r["loss"]) for r in rows if r["kind"] == "train"}
    assert [v for _, v in first["train/loss"]] == [pytest.approx(losses[s], rel=1e-6) for s in range(1, 7)]

    # resumed from step 4's checkpoint: steps 5 and 6 are trained (and logged) again
    result, p = train("--steps", 6, *common, *outs, "--resume", tmp_path / "ck" / "step-00000004", cache=cache)
    assert "at step 4" in p.stderr and result["steps"] == 6
    with open(tmp_path / "m.csv") as f:
        rows = list(csv.DictReader(f))
    train_steps = [int(r["step"]) for r in rows if r["kind"] == "train"]
    eval_steps = [int(r["step"]) for r in rows if r["kind"] == "eval"]
    assert train_steps == [1, 2, 3, 4, 5, 6] and eval_steps == [2, 4, 6]
    again = _scalars(tmp_path / "tb")
    # TensorBoard drops the first run's events from step 5 on (purge_step): one value per step
    assert [s for s, _ in again["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in again["eval/auc"]] == [2, 4, 6]


@pytest.mark.slow  # a 10-step run, ~25 s; the ETA's clock is tested below in the default suite
def test_progress_lines_in_a_log_carry_the_window_s_samples_per_s_and_an_eta(cache, tmp_path):
    """Without a terminal (a log file) a line per tenth of the run: step, loss, the samples/s of the
    steps since the last logged one, and the time left at that rate."""
    import re
    import subprocess
    import sys

    from .helpers import REPO

    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    args = ["train", "--synth-rows", "30000", "--steps", "10", "--eval-every", "0", "--curves-out", "none"]
    p = subprocess.run([sys.executable, "-m", "tpurec.cli", *args], env=env, capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = re.findall(r"step (\d+)/10: loss [0-9.]+, ([0-9,]+) samples/s, ETA (\d+):(\d\d)$", p.stderr, re.M)
    assert [int(s) for s, *_ in lines] == list(range(1, 11))
    assert all(int(sps.replace(",", "")) > 0 for _, sps, _, _ in lines)
    assert lines[-1][2:] == ("0", "00")  # nothing left at the last step


def test_eta_clock():
    from tpurec.dlrm.training.progress import clock

    assert [clock(s) for s in (0, 59.4, 61, 3599, 3600, 3 * 3600 + 62)] == [
        "0:00",
        "0:59",
        "1:01",
        "59:59",
        "1:00:00",
        "3:01:02",
    ]
