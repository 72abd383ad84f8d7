"""`--tensorboard DIR` and `--metrics-out` across a resume: TensorBoard's own reader loads the
scalars as docs/train.md names them, and a run resumed from an earlier checkpoint than its last
logged step leaves one metrics row per step and a curve that never loops back."""

from __future__ import annotations

import csv

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
