"""`tpurec train` on an emulated v5e (the TensorCore kernel's TPU kernels through the bridge's stand-in)
with the table updates landed as the updated rows' `index_copy_` (the default) instead of the new
tables' `copy_` (TPUREC_TC_UPDATE=copy): the same training. Row-wise Adagrad loss for loss, bit for
bit; Adam within 1e-6
(XLA compiles the two programs' arithmetic into different fusions: the last bit of a row may differ,
as it does for programs over different row counts, docs/results.md session 32)."""

from __future__ import annotations

import pytest

from tpurec.cli import main

from .helpers import train, train_losses


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    assert main(["data", "synth", "--rows", "8000", "--out", str(out / "data"), "--quiet"]) == 0
    return out / "data"


@pytest.mark.slow  # two emulated runs: about 30 s
@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_the_rows_route_trains_as_the_copy_route(data, cache, tmp_path, monkeypatch, optimizer):
    common = ["--emulate-tpu", "v5e-1", "--data", data, "--batch-size", 256, "--steps", 12, "--eval-every", 0]
    common += ["--curves-out", "none", "--log-every", 1, "--embedding-optimizer", optimizer]
    monkeypatch.delenv("TPUREC_TC_UPDATE", raising=False)
    landed, _ = train(*common, "--metrics-out", tmp_path / "rows.jsonl", cache=cache)
    monkeypatch.setenv("TPUREC_TC_UPDATE", "copy")
    copied, _ = train(*common, "--metrics-out", tmp_path / "copy.jsonl", cache=cache)
    assert copied is not None and landed is not None and landed["emulated_tpu"] == "v5e-1"
    losses = train_losses(tmp_path / "copy.jsonl")
    assert len(losses) == 12
    if optimizer == "rowwise_adagrad":
        assert train_losses(tmp_path / "rows.jsonl") == losses and landed["auc"] == copied["auc"]
    else:
        assert train_losses(tmp_path / "rows.jsonl") == pytest.approx(losses, rel=1e-6, abs=0)
        assert landed["auc"] == pytest.approx(copied["auc"], abs=1e-6)
