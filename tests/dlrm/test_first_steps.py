"""The first steps of `tpurec train`: the batch it plans for, the loss it shows, the AUC it trusts."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from .helpers import REPO, train


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _tpurec(*args):
    subprocess.run([sys.executable, "-m", "tpurec.cli", *map(str, args)], check=True, capture_output=True, cwd=REPO)


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
def test_a_huge_batch_on_a_small_dataset_is_capped_planned_and_its_auc_called_noisy(cache, tmp_path):
    data = tmp_path / "tiny"
    _tpurec("data", "synth", "--rows", "50", "--out", data)
    # The plan is made for the capped batch (the rows a rank holds): for 10 M rows it did not fit.
    result, p = train("--data", data, "--batch-size", 10_000_000, "--steps", 2, cache=cache)
    assert f"capping the batch at {result['batch_size']}\n" in p.stderr and result["batch_size"] < 50
    assert "does not fit" not in p.stderr and "GiB free" not in p.stderr
    assert f"AUC from {result['eval_rows']} eval rows is noisy (fewer than 1,000)" in p.stderr


def test_criteo_kaggle_first_steps_do_not_blow_up(cache, tmp_path, criteo_sample):
    data = tmp_path / "criteo"
    _tpurec("data", "convert", criteo_sample, "--out", data, "--table-set", "dlrm-tiny", "--quiet")
    metrics = tmp_path / "m.csv"
    args = ("--model", "criteo-kaggle", "--batch-size", 16, "--steps", 3, "--metrics-out", metrics)
    train("--data", data, *args, "--curves-out", "none", cache=cache)
    losses = [float(r["loss"]) for r in csv.DictReader(metrics.open()) if r["kind"] == "train"]
    # Without the warm-up, Adagrad's full-lr first step made step 2's loss 535,139.
    assert len(losses) == 3 and max(losses) < 10.0, losses
