"""`tpurec bench train --json`: both sides run on 2 ranks and the JSON has the documented keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_train_json(tmp_path):
    env = dict(os.environ, TPUREC_CACHE=str(tmp_path), PYTHONPATH=str(REPO))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpurec.cli",
            "bench",
            "train",
            "--tables",
            "tiny",
            "--json",
            "--steps",
            "20",
            "--warmup",
            "3",
            "--repeats",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    sides = ("torchrec-tw", "tpurec-tw", "torchrec", "tpurec")
    assert all(r[f"{side}_samples_per_s"] > 0 for side in sides)
    (rd,) = r["rounds"]
    assert sorted(rd["order"]) == sorted(sides)
    same = rd["tpurec-tw"]["samples_per_s"] / rd["torchrec-tw"]["samples_per_s"]
    assert r["ratio_vs_torchrec"] == pytest.approx(same, rel=1e-6)
    assert r["ratio_vs_torchrec_min"] == r["ratio_vs_torchrec_max"] == r["ratio_vs_torchrec"]
    own = rd["tpurec"]["samples_per_s"] / rd["torchrec"]["samples_per_s"]
    assert r["ratio_own_plans_vs_torchrec"] == pytest.approx(own, rel=1e-6)
    assert len(r["load_average"]["start"]) == 3 and len({tuple(rd[s]["inputs"]) for s in sides}) == 1
    assert r["torchrec-tw_plan"] == "26 table_wise/fused" and "customized_kernel" in r["tpurec_plan"]
    # the same starting tables (one checksum for all) and so losses that agree
    assert all(rd[s]["start_tables"] == pytest.approx(r["start_tables_checked"], rel=1e-9) for s in sides)
    assert r["loss_spread"] < 0.02, {s: r[f"{s}_final_loss"] for s in sides}


def _fake_launch(inputs_of, start_off=0.0):
    def launch(side, tables, data, nproc, steps, warmup, batch_size):
        rate = {"torchrec-tw": 100.0, "tpurec-tw": 120.0, "torchrec": 90.0, "tpurec": 110.0}[side]
        start = [1.0, 2.0 + (side == "tpurec") * start_off]
        loss = 0.5 + 0.01 * (side == "tpurec")
        return {
            "samples_per_s": rate,
            "cpu_samples_per_s": rate,
            "loss": loss,
            "plan": "p",
            "inputs": inputs_of(side),
            "start_tables": start,
        }

    return launch


def test_bench_train_rounds_in_random_order_with_worst_round(monkeypatch, tmp_path):
    from tpurec.bench import train
    from tpurec.dlrm import data

    monkeypatch.setattr(data, "ensure_synth", lambda *a, **k: tmp_path)
    monkeypatch.setattr(train, "launch", _fake_launch(lambda side: [10, 20, 3.0]))
    r = train.run(tables="tiny", steps=1, warmup=0, batch_size=8, repeats=6, order_seed=0)
    assert len({tuple(rd["order"]) for rd in r["rounds"]}) > 1  # a fresh order per round
    assert r["order_seed"] == 0 and train.run(tables="tiny", steps=1, warmup=0, batch_size=8)["order_seed"] != 0
    assert r["ratio_vs_torchrec"] == pytest.approx(1.2) and r["ratio_own_plans_vs_torchrec"] == pytest.approx(110 / 90)
    assert r["ratio_vs_torchrec_min"] == pytest.approx(1.2) and len(r["ratio_vs_torchrec_rounds"]) == 6
    assert r["loss_spread"] == pytest.approx(0.01) and r["start_tables_checked"] == [1.0, 2.0]


def test_bench_train_refuses_sides_that_trained_on_other_inputs(monkeypatch, tmp_path):
    from tpurec.bench import train
    from tpurec.dlrm import data

    monkeypatch.setattr(data, "ensure_synth", lambda *a, **k: tmp_path)
    monkeypatch.setattr(train, "launch", _fake_launch(lambda side: [10, 21 if side == "tpurec" else 20, 3.0]))
    with pytest.raises(RuntimeError, match="unequal work"):
        train.run(tables="tiny", steps=1, warmup=0, batch_size=8, repeats=1)


def test_bench_train_refuses_sides_that_started_from_other_tables(monkeypatch, tmp_path):
    from tpurec.bench import train
    from tpurec.dlrm import data

    monkeypatch.setattr(data, "ensure_synth", lambda *a, **k: tmp_path)
    monkeypatch.setattr(train, "launch", _fake_launch(lambda side: [10, 20, 3.0], start_off=1e-6))
    with pytest.raises(RuntimeError, match="unequal start"):
        train.run(tables="tiny", steps=1, warmup=0, batch_size=8, repeats=1)
