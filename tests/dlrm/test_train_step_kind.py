"""`tpurec train --step compiled|pipelined` (tpurec/dlrm/step_kind.py): a tiny synthetic run trains
through the pipelined step, and what the two steps cannot run is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.reliability.inproc import run_cli

from .helpers import train

COMMON: tuple[str | int, ...] = ("--dense-optimizer", "sgd", "--steps", 40, "--synth-rows", 30000, "--eval-every", 40)
COMMON += ("--device", "cpu", "--curves-out", "none")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def test_train_step_pipelined_trains(cache, tmp_path):
    metrics = tmp_path / "m.jsonl"
    result, p = train("--step", "pipelined", *COMMON, "--metrics-out", metrics, cache=cache)
    assert result is not None and result["step"] == "pipelined" and result["steps"] == 40
    assert "--step pipelined: the steady step runs eagerly" in p.stderr  # no --limits: not compiled
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses  # it learns


@pytest.mark.slow  # three runs and a `tpurec data stats`: about 40 s
def test_train_steps_against_eager(cache, tmp_path):
    """Measured limits fix the SparseCore buffer sizes: the compiled step runs one graph and ends
    where the eager step does (the same eval numbers); the pipelined one, compiled too, within the
    tables' one step of staleness (measured: AUC 0.6636 against 0.6609, logloss 0.5464 against 0.5460)."""
    import subprocess
    import sys

    from .helpers import REPO

    eager, _ = train("--step", "eager", *COMMON, cache=cache)
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
    compiled, _ = train("--step", "compiled", *COMMON, "--limits", limits, cache=cache)
    pipelined, p = train("--step", "pipelined", *COMMON, "--limits", limits, cache=cache)
    assert "--step pipelined: the steady step runs under torch.compile" in p.stderr
    assert eager is not None and compiled is not None and pipelined is not None
    assert compiled["step"] == "compiled" and pipelined["step"] == "pipelined"
    assert (compiled["auc"], compiled["logloss"]) == (eager["auc"], eager["logloss"])
    assert abs(pipelined["logloss"] - eager["logloss"]) < 5e-3 and abs(pipelined["auc"] - eager["auc"]) < 0.01


REFUSED = [
    (["--step", "pipelined"], "--step pipelined runs plain SGD on the dense parameters: give --dense-optimizer sgd"),
    (["--step", "compiled", "--dense-optimizer", "sgd"], "--step compiled needs fixed SparseCore buffer sizes"),
    (["--step", "pipelined", "--dense-optimizer", "sgd", "--warmup-steps", "5"], "keeps the dense lr fixed"),
    (["--step", "pipelined", "--dense-optimizer", "sgd", "--zch"], "without --zch"),
]


@pytest.mark.parametrize("flags,says", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_train_step_refusals(capsys, flags, says):
    code, _, err = run_cli(["train", *flags], capsys)
    assert code == 2 and says in err and "Traceback" not in err and err.strip().count("\n") == 0, err


ON_TPU = [
    (["--step", "pipelined", "--dense-optimizer", "sgd", "--device", "tpu"], "not yet run on a real TPU"),
    (
        ["--step", "compiled", "--dense-optimizer", "sgd", "--device", "tpu", "--limits", "L.json"],
        "not yet run on a real TPU",
    ),
]


@pytest.mark.parametrize("flags,says", ON_TPU, ids=[" ".join(f) for f, _ in ON_TPU])
def test_train_step_refusals_on_a_real_tpu(capsys, monkeypatch, flags, says):
    monkeypatch.delenv("TPUREC_EMULATE_TPU", raising=False)
    code, _, err = run_cli(["train", *flags], capsys)
    assert code == 2 and says in err and "Traceback" not in err and err.strip().count("\n") == 0, err


def test_default_backend_follows_the_tables_device():
    """backend=None: TorchTPU's "tpu" where the sharded tables are on a tpu device, else aot_eager."""
    from types import SimpleNamespace

    from tpurec.sharding.compiled_step import default_backend

    assert default_backend(SimpleNamespace(_device=torch.device("cpu"))) == "aot_eager"
    assert default_backend(SimpleNamespace(_device=None)) == "aot_eager"
    assert default_backend(SimpleNamespace(_device="tpu:0")) == "tpu"
