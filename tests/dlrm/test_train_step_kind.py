"""`tpurec train --step compiled|pipelined` (tpurec/sharding/step/kinds.py): a tiny synthetic run trains
through the pipelined step with the config's dense optimizer (dlrm-tiny's: adagrad) and an lr
warm-up and decay, and what the two steps cannot run is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.reliability.inproc import run_cli

from .helpers import checkpoint_tensors, train, train_here

# the default dense optimizer (adagrad) and every step of the 40 with another lr: 10 of warm-up,
# then a decay from step 20 over 25 steps
COMMON: tuple[str | int, ...] = ("--steps", 40, "--synth-rows", 30000, "--eval-every", 40)
COMMON += ("--warmup-steps", 10, "--decay-start", 20, "--decay-steps", 25, "--device", "cpu", "--curves-out", "none")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def test_train_step_pipelined_trains(cache, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    result, _, err = train_here(capsys, "--step", "pipelined", *COMMON, "--metrics-out", metrics, cache=cache)
    assert result is not None and result["step"] == "pipelined" and result["steps"] == 40
    assert "--step pipelined: the steady step runs eagerly" in err  # no --limits: not compiled
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses  # it learns


@pytest.mark.slow  # five runs and a `tpurec data stats`: about 50 s
def test_train_steps_against_eager(cache, tmp_path):
    """Measured limits fix the SparseCore buffer sizes: the compiled step runs one graph and ends
    where the eager step does (the same eval numbers, adagrad and the lr schedule included), also
    when resumed from its step-20 checkpoint (the dense optimizer's state is the checkpointed
    optimizer's); the pipelined one, compiled too, within the tables' one step of staleness
    (measured: AUC 0.7002 against 0.7081, logloss 0.5235 against 0.5219)."""
    import subprocess
    import sys

    from .helpers import REPO

    def ck(name: str) -> tuple:
        return ("--checkpoint-dir", tmp_path / name, "--checkpoint-every", 20, "--keep", 0)

    def logged(name: str) -> tuple:
        return ("--metrics-out", tmp_path / f"{name}.jsonl")

    def losses(name: str) -> list[float]:
        rows = map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
        return [r["loss"] for r in rows if r["kind"] == "train"]

    # the eager run's SparseCore buffers from the same limits: its kernels then sum what the compiled
    # step's sum (without, batches over the default limits go in several passes, another float order)
    train("--step", "eager", "--steps", 1, "--synth-rows", 30000, "--eval-every", 0, cache=cache)  # the data
    data = cache / "synth-dlrm-tiny-30000-0"
    limits = tmp_path / "limits.json"
    stats = ["data", "stats", data, "--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", 512]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *map(str, stats), "--out", str(limits), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    fixed = ("--limits", limits)
    eager, _ = train("--step", "eager", *COMMON, *fixed, *ck("eager"), *logged("eager"), cache=cache)
    compiled, p = train("--step", "compiled", *COMMON, *fixed, *ck("compiled"), *logged("compiled"), cache=cache)
    assert "--step compiled: the steady step runs under torch.compile" in p.stderr
    at_20 = ("--resume", tmp_path / "compiled" / "step-00000020")
    resumed, p = train("--step", "compiled", *COMMON, *fixed, *ck("resumed"), *logged("resumed"), *at_20, cache=cache)
    assert "at step 20" in p.stderr
    pipelined, p = train("--step", "pipelined", *COMMON, *fixed, cache=cache)
    assert "--step pipelined: the steady step runs under torch.compile" in p.stderr
    assert eager is not None and compiled is not None and pipelined is not None and resumed is not None
    assert compiled["step"] == "compiled" and pipelined["step"] == "pipelined"
    assert losses("compiled") == losses("eager") and len(losses("eager")) == 40  # every step's, bit for bit
    assert losses("resumed")[-20:] == losses("compiled")[20:]
    assert (compiled["auc"], compiled["logloss"]) == (eager["auc"], eager["logloss"])
    assert (resumed["auc"], resumed["logloss"]) == (eager["auc"], eager["logloss"])
    # at step 40, uninterrupted and resumed from step 20: tables, dense weights and both optimizers'
    # state (the dense adagrad's step and sum) bit-equal to the eager run's
    want = checkpoint_tensors(tmp_path / "eager" / "step-00000040")
    assert any(k.endswith("sum") for k in want), sorted(want)[:20]
    for name in ("compiled", "resumed"):
        got = checkpoint_tensors(tmp_path / name / "step-00000040")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], v) for k, v in want.items() if isinstance(v, torch.Tensor)), name
    assert abs(pipelined["logloss"] - eager["logloss"]) < 5e-3 and abs(pipelined["auc"] - eager["auc"]) < 0.01


REFUSED = [
    (
        ["--step", "pipelined", "--dense-optimizer", "rowwise_adagrad"],
        "--step pipelined updates the dense parameters with --dense-optimizer sgd|adagrad|adam (not rowwise_adagrad)",
    ),
    (["--step", "compiled"], "--step compiled needs fixed SparseCore buffer sizes"),
    (["--step", "pipelined", "--zch"], "without --zch"),
]


@pytest.mark.parametrize("flags,says", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_train_step_refusals(capsys, flags, says):
    code, _, err = run_cli(["train", *flags], capsys)
    assert code == 2 and says in err and "Traceback" not in err and err.strip().count("\n") == 0, err


ON_TPU = [
    (["--step", "pipelined", "--device", "tpu"], "a real TPU (use --step eager there, or TPUREC_STEP_ON_TPU=1"),
    (["--step", "compiled", "--device", "tpu", "--limits", "L.json"], "runs on a TPU v5e but slower than --step eager"),
]


@pytest.mark.parametrize("flags,says", ON_TPU, ids=[" ".join(f) for f, _ in ON_TPU])
def test_train_step_refusals_on_a_real_tpu(capsys, monkeypatch, flags, says):
    monkeypatch.delenv("TPUREC_EMULATE_TPU", raising=False)
    code, _, err = run_cli(["train", *flags], capsys)
    assert code == 2 and says in err and "Traceback" not in err and err.strip().count("\n") == 0, err


def test_the_step_on_tpu_flag_lets_a_real_tpu_try_it(capsys, monkeypatch):
    """TPUREC_STEP_ON_TPU=1: no refusal of the step; on this host without a TPU the run then stops at
    the device, in one line."""
    monkeypatch.delenv("TPUREC_EMULATE_TPU", raising=False)
    monkeypatch.setenv("TPUREC_STEP_ON_TPU", "1")
    code, _, err = run_cli(["train", "--step", "pipelined", "--device", "tpu", "--steps", "2"], capsys)
    assert "real TPU" not in err and "--step" not in err, err
    assert code != 0 and "TPU" in err and "Traceback" not in err and err.strip().count("\n") == 0, err


def test_default_backend_follows_the_tables_device():
    """backend=None: TorchTPU's "tpu" where the sharded tables are on a tpu device, else aot_eager."""
    from types import SimpleNamespace

    from tpurec.sharding.step.compiled import default_backend

    assert default_backend(SimpleNamespace(_device=torch.device("cpu"))) == "aot_eager"
    assert default_backend(SimpleNamespace(_device=None)) == "aot_eager"
    assert default_backend(SimpleNamespace(_device="tpu:0")) == "tpu"
