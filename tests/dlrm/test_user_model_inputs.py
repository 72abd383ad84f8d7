"""What `tpurec train --model-module` says of a user's own Parquet before and as it trains (#63 item 5):
a dense column of large values is named in a notice; a dense count other than the model's names
what the column mapping inferred, and is refused before any rank starts."""

from __future__ import annotations

import json
import time

import numpy as np

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO

MODEL = f"{REPO / 'tests' / 'dlrm' / 'mc_user_model.py'}:build"  # 2 dense features; user_id, item_id


def _parquet(path, **extra) -> str:
    import pandas as pd

    rng = np.random.default_rng(1)
    n = 1024
    df = pd.DataFrame({"label": rng.integers(0, 2, n), "d0": rng.random(n)})
    df["user_id"] = rng.integers(0, 10**6, n)
    df["item_id"] = rng.integers(0, 10**6, n)
    for name, values in extra.items():
        df[name] = values(rng, n)
    df.to_parquet(path)
    return str(path)


def test_a_dense_column_of_large_values_is_named_in_a_notice(tmp_path, capsys, monkeypatch):
    """d1 reaches 5,080 (the files' statistics say so): named with its largest value; d0 (< 1) is not."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data = _parquet(tmp_path / "big.parquet", d1=lambda rng, n: np.r_[5080.0, rng.random(n - 1) * 3000])
    args = ["train", "--quiet", "--curves-out", "none", "--model-module", MODEL, "--data", data, "--steps", 1]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 1
    notice = next(line for line in err.splitlines() if line.startswith("notice:"))
    assert notice.startswith("notice: dense column(s) d1 (up to 5,080) go to the model as stored: values this large")
    assert "d0" not in notice


def test_an_integer_column_inferred_as_sparse_is_named_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """`hour` (integers) is inferred sparse, no table reads it, so the data has 1 dense column for a
    model of 2: one line from the launcher naming the inference and the --dense that fixes it (was
    `rank 0: ... 1 dense column(s); --model-module ... takes 2` after the 2 ranks started); with that
    --dense the model trains."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data = _parquet(tmp_path / "hour.parquet", hour=lambda rng, n: rng.integers(0, 24, n))
    common = ["train", "--quiet", "--curves-out", "none", "--model-module", MODEL, "--data", data, "--steps", 1]
    t0 = time.monotonic()
    code, _, err = run_cli([*common, "--nproc", 2], capsys)
    says = (
        f"{data}: 1 dense column(s) (d0); --model-module {MODEL} takes 2 (its dense_in_features); the column mapping "
        "inferred integer column(s) hour as sparse, and no table of the model reads them: give --dense d0,hour "
        "(or --columns FILE) to read them as dense"
    )
    assert_refused(code, err, says, prefix="tpurec train: error")
    assert "rank" not in err and time.monotonic() - t0 < 15  # no rank started (they take 16-22 s to say it)
    code, out, err = run_cli([*common, "--dense", "d0,hour"], capsys)
    assert code == 0, err[-3000:]


def test_a_missing_feature_column_is_refused_by_the_launcher(tmp_path, capsys, monkeypatch):
    """`--sparse user_id` leaves out item_id's column: the launcher of 2 ranks says so (was `ranks 0-1:`)."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data = _parquet(tmp_path / "x.parquet", d1=lambda rng, n: rng.random(n))
    args = ["train", "--quiet", "--model-module", MODEL, "--data", data, "--sparse", "user_id", "--nproc", 2]
    code, _, err = run_cli(args, capsys)
    assert_refused(code, err, f"{data}: no column for feature(s) item_id of --model-module {MODEL}", prefix="tpurec")
    assert "rank" not in err
