"""`tpurec train --dense-transform log1p` (issue 63 item 5): the dense columns of Parquet tpurec did
not write read as log(1 + max(x, 0)), as Criteo's are converted, instead of as stored."""

from __future__ import annotations

import json

import numpy as np

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO

MODEL = f"{REPO / 'tests' / 'dlrm' / 'mc_user_model.py'}:build"  # 2 dense features; user_id, item_id


def _parquet(path, n: int = 2048) -> tuple[str, np.ndarray]:
    """label, d0 in [0, 1), d1 counts up to 5,080 and one -3 (clamped to 0), user_id, item_id."""
    import pandas as pd

    rng = np.random.default_rng(1)
    d1 = np.r_[5080.0, -3.0, rng.random(n - 2) * 3000]
    df = pd.DataFrame({"label": rng.integers(0, 2, n), "d0": rng.random(n), "d1": d1})
    df["user_id"] = rng.integers(0, 10**6, n)
    df["item_id"] = rng.integers(0, 10**6, n)
    df.to_parquet(path)
    return str(path), df[["d0", "d1"]].to_numpy()


def test_the_reader_gives_log1p_of_the_mapped_dense_columns(tmp_path):
    from tpurec.data.mapped import open_source
    from tpurec.data.reader import ParquetReader
    from tpurec.data.schema import DENSE_LOG1P

    data, stored = _parquet(tmp_path / "d.parquet")
    source = open_source(data, None)
    plain = ParquetReader(data, 2048, source=source, table_sizes=[1000, 1000])
    logged = ParquetReader(data, 2048, source=source, table_sizes=[1000, 1000], dense_transform=DENSE_LOG1P)
    as_stored, transformed = next(iter(plain)).dense_features.numpy(), next(iter(logged)).dense_features.numpy()
    np.testing.assert_array_equal(as_stored, stored.astype(np.float32))
    np.testing.assert_allclose(transformed, np.log1p(np.maximum(stored, 0)).astype(np.float32), rtol=1e-6)
    assert transformed[0, 1] == np.float32(np.log1p(5080.0)) and transformed[1, 1] == 0.0  # 8.53; -3 clamped


def _first_losses(capsys, tmp_path, data, *flags) -> tuple[list[float], str]:
    metrics = tmp_path / f"m{len(flags)}.jsonl"
    args = ["train", "--quiet", "--curves-out", "none", "--model-module", MODEL, "--data", data, "--steps", 4]
    code, _, err = run_cli([*args, "--batch-size", 256, "--metrics-out", metrics, *flags], capsys)
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], err


def test_train_with_log1p_starts_from_a_small_loss_and_says_so(tmp_path, capsys, monkeypatch):
    """As stored, d1 (up to 5,080) saturates the fresh MLP: the first losses are large and the notice
    names d1; read as log1p, they stay near log(2) and the notice gives way to a line saying so."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data, _ = _parquet(tmp_path / "d.parquet")
    raw, err = _first_losses(capsys, tmp_path, data)
    assert "notice: dense column(s) d1 (up to 5,080)" in err and "--dense-transform log1p" in err
    logged, err = _first_losses(capsys, tmp_path, data, "--dense-transform", "log1p")
    assert "data: every dense column read as log(1 + max(x, 0)) (--dense-transform log1p)" in err
    assert "notice: dense column" not in err
    # measured: 104.0, 58.6, 32.9, 10.6 as stored; 0.796, 0.706, 0.695, 0.697 as log1p
    assert raw[0] > 10 and max(logged) < 1.0, (raw, logged)


def test_data_stored_as_log1p_already_is_refused(tmp_path, capsys, monkeypatch):
    """tpurec's synthetic data (and its converted Criteo) hold log(1 + x) already: a second one is refused."""
    from tpurec.data.synth import synthesize

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    synthesize(2000, str(tmp_path / "synth"), seed=5, show_progress=False)
    code, _, err = run_cli(["train", "--data", tmp_path / "synth", "--dense-transform", "log1p"], capsys)
    says = f"--dense-transform log1p: {tmp_path / 'synth'}'s dense values are stored as log1p_clamp0 already"
    assert_refused(code, err, says)
    code, _, err = run_cli(["train", "--dense-transform", "log1p"], capsys)
    assert_refused(code, err, "--dense-transform transforms --data's dense columns; the synthetic data's are")
