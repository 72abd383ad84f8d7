"""`tpurec train --keep-best` and `--early-stop N` (issue 63 item 7: a long run's eval AUC peaked at
step 500 and fell by step 4,000, with no checkpoint of the peak and no way to stop there)."""

from __future__ import annotations

import json

import torch

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import checkpoint_tensors

# dlrm-tiny on 3,000 synthetic rows, batch 128 (3 epochs by step 60), 900 eval rows: measured, the
# eval AUC peaks at step 30 (0.6019) and stays below it at steps 40, 50 and 60.
RUN = [
    "train", "--quiet", "--synth-rows", 3000, "--curves-out", "none", "--keep", 0, "--batch-size", 128,
    "--eval-every", 10, "--eval-fraction", 0.3, "--early-stop", 3, "--keep-best",
]  # fmt: skip


def _train(capsys, *args) -> tuple[dict, str]:
    code, out, err = run_cli([*RUN, *args], capsys)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _evals(metrics) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["auc"] for r in rows if r["kind"] == "eval"}


def test_the_best_evaluations_checkpoint_is_kept_and_the_run_stops_after_n_without_a_better(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    result, err = _train(capsys, "--steps", 300, "--checkpoint-dir", ckpt, "--metrics-out", metrics)
    aucs = _evals(metrics)
    best = max(aucs, key=lambda s: aucs[s])
    assert best == 30 and sorted(aucs) == [10, 20, 30, 40, 50, 60]  # stopped at the 3rd eval after the best
    assert all(aucs[s] < aucs[30] for s in (40, 50, 60))
    assert result["steps"] == 60 and result["auc"] == round(aucs[60], 6)  # the last evaluation, not repeated
    kept = ckpt / "best" / "step-00000030"
    assert result["best"] == {"step": 30, "auc": round(aucs[30], 6), "checkpoint": str(kept)}
    assert result["early_stop"] == {"step": 60, "steps_asked": 300, "evaluations": 3, "best_step": 30}
    assert f"  best eval      AUC {aucs[30]:.4f} at step 30: {kept}" in err
    assert "  early stop     at step 60 of 300: 3 evaluation(s) in a row without an AUC above step 30's" in err
    # the one best checkpoint (step 10's, the best before it, is gone), beside the run's own
    assert [p.name for p in (ckpt / "best").iterdir()] == ["step-00000030"]
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:08d}" for s in (10, 20, 30, 40, 50, 60)]
    meta = json.loads((kept / "meta.json").read_text())
    assert meta["step"] == 30 and meta["eval"]["auc"] == aucs[30]
    # it is the model at step 30: every tensor equal to the run's periodic checkpoint there
    a, b = checkpoint_tensors(kept), checkpoint_tensors(ckpt / "step-00000030")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and it resumes: --resume CKPT/best takes it
    again, err = _train(capsys, "--steps", 31, "--checkpoint-dir", tmp_path / "other", "--resume", ckpt / "best")
    assert f"resume: {kept} at step 30" in err and again["steps"] == 31


def test_a_resumed_run_compares_and_counts_as_the_uninterrupted_one(tmp_path, capsys, monkeypatch):
    """40 steps (the final evaluation, after the final checkpoint, not in it), then resumed to 300:
    the same best and the same stop as one run of 300 (above)."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first, _ = _train(capsys, "--steps", 40, "--checkpoint-dir", ckpt, "--metrics-out", metrics)
    assert first["best"]["step"] == 30 and "early_stop" not in first
    result, _ = _train(capsys, "--steps", 300, "--checkpoint-dir", ckpt, "--metrics-out", metrics, "--resume")
    aucs = _evals(metrics)
    assert sorted(aucs) == [10, 20, 30, 40, 50, 60]  # step 40's evaluation once (evaluated again, not logged)
    assert result["early_stop"] == {"step": 60, "steps_asked": 300, "evaluations": 3, "best_step": 30}
    assert result["best"]["step"] == 30 and result["best"]["auc"] == round(aucs[30], 6)
    assert [p.name for p in (ckpt / "best").iterdir()] == ["step-00000030"]


def test_keep_best_and_early_stop_need_evaluations_and_a_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(["train", "--synth-rows", 3000, "--keep-best", "--eval-every", 10], capsys)
    assert_refused(code, err, "--keep-best keeps a checkpoint in --checkpoint-dir/best/; give --checkpoint-dir")
    code, _, err = run_cli(["train", "--synth-rows", 3000, "--early-stop", 2, "--eval-every", 0], capsys)
    assert_refused(code, err, "--early-stop compares the evaluations of --eval-every N; give --eval-every")
