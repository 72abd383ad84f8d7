"""`tpurec launch` of a user's program ends with the checks `tpurec train` reports (ranks, hosts,
programs compiled, recompiles after warm-up, device->host copies per step): tpurec/runtime/run_report.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch(*args: str) -> tuple[dict, str]:
    """(the program's own JSON line, the launcher's end-of-run line)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tpurec.cli", "launch", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("tpurec launch: ")]
    assert len(lines) == 1, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), lines[0]


@pytest.mark.slow  # 4 emulated ranks: about 45 s
@pytest.mark.multiprocess
def test_a_program_that_does_not_mark_its_steps_gets_them_from_its_dmp_forwards():
    """examples/quickstart.py on the emulated device: its 60 steps are its DMP's forwards with gradients
    (its evaluation runs under no_grad); its per-step copies are its own loss read and its KJT, which it
    moves to the device and tpurec's input distribution brings back (two KJT copies a step)."""
    own, line = _launch("--emulate-tpu", "v5p-8", "examples/quickstart.py", "--quick", "--device", "tpu")
    assert line.startswith(
        f"tpurec launch: {own['world_size']} rank(s) on 1 host(s) (emulated v5p-8), {own['steps']} training step(s); "
    ), line
    sparsecore = re.search(r"programs compiled \(sparsecore (\d+),", line)
    assert sparsecore and int(sparsecore.group(1)) >= 1, line  # the lookup (and its update) on the SparseCore op
    # 58 steps after the 2 of warm-up: one read of the loss and two KJT copies off the device in each
    assert line.endswith("; 3 device->host copies per step (__main__.main 58, torchrec.sparse.jagged_tensor.to 116)")


@pytest.mark.slow  # 4 emulated ranks: about 60 s
@pytest.mark.multiprocess
def test_a_program_that_marks_its_steps_gets_the_figures_it_computes_itself():
    """examples/sequential_recommender.py marks its steps (EmulatedRank.begin) and prints its own
    recompiles and copies per step: the launcher's line says the same."""
    own, line = _launch(
        "--emulate-tpu", "v5p-8", "examples/sequential_recommender.py", "--steps", "30", "--device", "tpu"
    )
    assert f"{own['world_size']} rank(s) on 1 host(s) (emulated v5p-8), 30 training step(s)" in line, line
    assert f"; {own['recompiles_after_warmup']} recompile(s) after warm-up;" in line, line
    assert f"; {own['device_to_host_copies_per_step']:g} device->host copies per step" in line, line
