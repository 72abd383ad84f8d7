"""Out-of-domain command-line values are refused with one line naming the flag and exit code 2,
before anything heavy starts (table-driven: add a row per new flag)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CASES = [
    (
        ["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--headroom", "-1"],
        r"--headroom: '-1' must be in [0, 1)",
    ),
    (["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--dcn-gbps", "-5"], "--dcn-gbps: '-5' must be > 0"),
    (["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--batch-size", "0"], "--batch-size: '0' must be > 0"),
    (
        ["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--sc-gather-fraction", "nan"],
        "--sc-gather-fraction: 'nan' is not a finite number",
    ),
    (["train", "--embedding-lr", "nan"], "--embedding-lr: 'nan' is not a finite number"),
    (["train", "--dense-lr", "-0.1"], "--dense-lr: '-0.1' must be >= 0"),
    (["train", "--batch-size", "0"], "--batch-size: '0' must be > 0"),
    (["train", "--eval-fraction", "1.5"], "--eval-fraction: '1.5' must be in [0, 1)"),
    (["train", "--steps", "ten"], "--steps: 'ten' is not a whole number"),
    (["train", "--embedding-weight-decay", "-1"], "--embedding-weight-decay: '-1' must be >= 0"),
    (["train", "--embedding-weight-decay", "nan"], "--embedding-weight-decay: 'nan' is not a finite number"),
    (["train", "--embedding-weight-decay-mode", "bogus"], "invalid choice: 'bogus' (choose from 'NONE', 'L2'"),
    (["data", "synth", "--out", "/tmp/never-written", "--rows", "-3"], "--rows: '-3' must be > 0"),
]


def _run(args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_out_of_domain_flag_is_refused_with_one_line(args, message):
    p = _run(args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_resume_from_a_directory_that_does_not_exist_is_refused(tmp_path):
    p = _run(["train", "--checkpoint-dir", str(tmp_path / "typo"), "--resume"])
    assert p.returncode == 2
    assert f"--resume: {tmp_path / 'typo'} does not exist (leave out --resume to start a new run)" in p.stderr


def test_result_line_is_strict_json():
    from tpurec.dlrm.report import json_safe

    line = json.dumps(json_safe({"auc": float("nan"), "ne": float("inf"), "steps": 3, "x": [1.0, float("-inf")]}))
    assert json.loads(line) == {"auc": None, "ne": None, "steps": 3, "x": [1.0, None]}
    assert "NaN" not in line and "Infinity" not in line


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "dlrm-tiny"],
        ["--model", "dlrm-tiny", "--topology", "v6e-3"],
        ["--tables", "tests/data/no_such_tables.yaml", "--topology", "v6e-4"],
        ["--model-module", "no_colon", "--topology", "v6e-4"],
    ],
)
def test_plan_argument_errors_come_before_torch_is_imported(args):
    code = (
        "import sys; from tpurec.cli import main; rc = main(['plan', *sys.argv[1:]]); "
        "print('RC', rc, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "RC 2 False" in p.stdout, (p.stdout, p.stderr)
