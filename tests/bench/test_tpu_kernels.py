"""`tpurec bench tpu-kernels --cpu`: the smoke run CI can do (the figures come from a TPU: docs/results.md)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from tpurec.cli import main  # noqa: E402


def test_the_cpu_smoke_run_reports_every_op_with_equal_work(capsys):
    assert main(["bench", "tpu-kernels", "--cpu", "--json", "--seed", "3", "--ops", "sgd,rowwise_adagrad"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seed"] == 3 and doc["device"] == "cpu" and len(doc["load_average"]["before"]) == 3
    assert [c["op"] for c in doc["cells"]] == ["sgd", "rowwise_adagrad"]
    for cell in doc["cells"]:
        # both contenders did the same update: their tables agree to float32 rounding
        assert 0 <= cell["equal_work_max_abs_diff"] < 1e-5
        assert len(cell["vs_xla"]["round_ratios"]) == 2 and cell["ms"]["tpurec"] > 0 and cell["ms"]["xla"] > 0
    assert set(doc["summary"]) == {"sgd", "rowwise_adagrad"}
    assert doc["summary"]["sgd"]["best_share_of_hbm"] is None  # no HBM figure for a CPU


def test_off_a_tpu_without_cpu_it_is_one_line(capsys):
    assert main(["bench", "tpu-kernels"]) == 2
    assert "JAX sees no TPU here (its backend: cpu)" in capsys.readouterr().err


def test_cells_are_listed_and_picked_by_number(capsys):
    assert main(["bench", "tpu-kernels", "--list-cells"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("0  1000000x128 float32 B16384 H8 uniform") and len(listed) >= 9
    assert main(["bench", "tpu-kernels", "--cells", "0,99"]) == 2
    assert "--cells: numbers in 0..8" in capsys.readouterr().err
