"""scripts/tpu_chip_runs.py: every step's tpurec command is one tpurec's parser takes (a flag renamed or
removed since would cost a chip session's device time to find out), and a step runs with its output,
log and scratch where the device tool returns them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script
from tpurec.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("tpu_chip_runs")


def test_every_steps_command_parses_and_names_a_script_that_exists(tmp_path):
    runs = _script()
    steps = runs.steps(str(tmp_path))
    assert list(steps) == [
        "tt",
        "tt-long",
        "tt-split",
        "tt-narrow",
        "tt-steps",
        "tt-steps-eager",
        "tt-steps-copy",
        "tt-steps-narrow",
        "tt-steps-foreach",
        "tt-steps-serial",
        "tt-steps-nogatherpad",
        "tt-steps-s40pool",
        "tt-steps-updatepad",
        "tt-foreach",
        "split",
        "split-eager",
        "split-copy",
        "split-narrow",
        "split-xla",
        "split-merge",
        "host",
        "link",
        "inplace",
        "update",
        "dense-bags",
        "gather",
        "lookup-pool",
        "gather-placement",
        "update-copies",
        "scatter-rule",
        "gather-sweep",
        "compiled",
        "pipelined",
        "kernels",
        "kernels-updatepad",
    ]
    for name, step in steps.items():
        if step.script:
            assert (REPO / step.argv[0]).is_file(), name
            continue
        args = build_parser().parse_args(step.argv)
        assert callable(args.run), name
        assert step.limit_s <= 590  # one call of the device tool runs 600 s at most
    assert build_parser().parse_args(steps["host"].argv).pinned
    assert build_parser().parse_args(steps["compiled"].argv).tpurec_args == "--step compiled"
    eager = build_parser().parse_args(steps["tt-steps-eager"].argv).tpurec_args.split()
    assert build_parser().parse_args(["train", *eager]).eager_dense  # a flag `tpurec train` takes


def test_a_step_writes_its_output_and_log_and_removes_its_scratch(tmp_path, monkeypatch):
    runs = _script()
    (tmp_path / "w").mkdir()
    step = runs.Step(60, ["-c", "import sys; print('{}'); print('said', file=sys.stderr)"], scratch="w")
    monkeypatch.setattr(runs, "command", lambda s: [sys.executable, *s.argv])
    assert runs.run("bench", step, tmp_path) == 0
    assert (tmp_path / "bench.json").read_text() == "{}\n"
    log = (tmp_path / "runs.log").read_text()
    assert "bench start" in log and "bench rc=0" in log and "said" in log
    assert not (tmp_path / "w").exists()


def test_probes_share_one_stdout_file_so_a_call_returns_fewer_files(tmp_path, monkeypatch):
    runs = _script()
    monkeypatch.setattr(runs, "command", lambda s: [sys.executable, *s.argv])
    for name, said in (("p1", "one"), ("p2", "two")):
        assert runs.run(name, runs.Step(60, ["-c", f"print({said!r})"], script=True), tmp_path) == 0
    assert (tmp_path / "probes.log").read_text() == "== p1\none\n== p2\ntwo\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probes.log", "runs.log"]


def test_an_unknown_step_is_refused(capsys):
    with pytest.raises(SystemExit):
        _script().main(["tt", "nope"])
    assert "unknown steps ['nope']" in capsys.readouterr().err
