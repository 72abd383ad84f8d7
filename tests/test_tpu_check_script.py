"""scripts/tpu_check.py's reading of two trains' metrics (the chip's run against the CPU's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("tpu_check", REPO / "scripts" / "tpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics(path: Path, rows: list[tuple[int, float, float]]) -> Path:
    lines = [json.dumps({"steps": 99})]  # the result line is not a train row
    lines += [json.dumps({"kind": "train", "step": s, "seconds": t, "loss": loss}) for s, t, loss in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_losses_are_compared_step_by_step_and_a_compile_spike_after_warmup_is_named(tmp_path):
    check = _script()
    # 2 ms a step, but steps 12 -> 14 took 40 ms (a recompile); step 4's loss 2e-4 apart
    times = [(s, 0.002 * s + (0.036 if s >= 14 else 0.0)) for s in range(2, 21, 2)]
    tpu = _metrics(tmp_path / "tpu.jsonl", [(s, t, 1.0 / s + (2e-4 if s == 4 else 0.0)) for s, t in times])
    cpu = _metrics(tmp_path / "cpu.jsonl", [(s, t, 1.0 / s) for s, t in times])
    got = check.compare(tpu, cpu)
    assert got["logged_steps"] == 10 and got["steps_only_in_one"] == []
    assert abs(got["max_abs_loss_diff"] - 2e-4) < 1e-12 and got["worst_step"] == 4
    assert got["losses_within_tolerance"] is False
    assert got["tpu_median_step_ms_after_warmup"] == 2.0
    assert got["tpu_steps_over_5x_median_after_warmup"] == [(14, 20.0)]
    same = check.compare(cpu, cpu)
    assert same["losses_within_tolerance"] is True and same["max_abs_loss_diff"] == 0.0
