"""`tpurec train`'s summary on the terminal (tpurec/dlrm/report.py `summary_text`)."""

from __future__ import annotations

from tpurec.dlrm.report import summary_text

RESULT = {
    "model": "dlrm-tiny",
    "world_size": 8,
    "batch_size": 64,
    "steps": 30,
    "seconds": 12.0,
    "samples_per_s": 1280.0,
    "auc": 0.65,
    "ne": 0.95,
    "logloss": 0.56,
    "accuracy": 0.75,
    "eval_rows": 4000,
}


def test_recompiles_after_warmup_are_said_on_the_terminal():
    # was: only in the JSON line
    text = summary_text(
        dict(RESULT, recompiles_after_warmup=3, recompiled_ops={"aten::mul.Tensor": 2, "aten::add.Tensor": 1}), "D"
    )
    assert text.splitlines()[-1] == (
        "  warning        3 program(s) compiled after warm-up (aten::mul.Tensor 2, aten::add.Tensor 1): a shape or "
        "dtype followed the data, and on a TPU each is a new compilation mid-run (recompiles_after_warmup, "
        "recompiled_ops in the JSON line)"
    )


def test_no_recompile_line_for_zero_none_or_a_cpu_run():
    lines = summary_text(RESULT, "D").splitlines()
    assert lines[-1] == "  eval NE        0.9500   logloss 0.5600   accuracy 0.7500   (4,000 rows)"
    for count in (0, None):
        assert summary_text(dict(RESULT, recompiles_after_warmup=count, recompiled_ops={}), "D").splitlines() == lines
