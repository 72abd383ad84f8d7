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
    (its evaluation runs under no_grad); its one copy a step is its own loss read: it keeps the ids on
    the host (it moved its KJT to the device, which tpurec's input distribution brought back: two
    more copies a step, issue 63 item 3)."""
    own, line = _launch("--emulate-tpu", "v5p-8", "examples/quickstart.py", "--quick", "--device", "tpu")
    assert line.startswith(
        f"tpurec launch: {own['world_size']} rank(s) on 1 host(s) (emulated v5p-8), {own['steps']} training step(s); "
    ), line
    sparsecore = re.search(r"programs compiled \(sparsecore (\d+),", line)
    assert sparsecore and int(sparsecore.group(1)) >= 1, line  # the lookup (and its update) on the SparseCore op
    # 58 steps after the 2 of warm-up: one read of the loss in each
    assert line.endswith("; 1 device->host copies per step (__main__.main 58)"), line


def _documented_rehearsal() -> list[str]:
    """The command README.md gives to rehearse a TPU slice (docs/tpu.md gives the same)."""
    command = re.search(
        r"`(tpurec launch --emulate-tpu \S+ examples/quickstart\.py)`", (REPO / "README.md").read_text()
    )
    assert command is not None
    assert command.group(1) in (REPO / "docs" / "tpu.md").read_text().replace("\n", " ")
    return command.group(1).split()[2:]  # launch's arguments


def _on_the_tpu_path(line: str, ranks: int, slice_name: str) -> None:
    assert line.startswith(f"tpurec launch: {ranks} rank(s) on {ranks // 4 or 1} host(s) (emulated {slice_name}), "), (
        line
    )
    assert "nothing ran on the emulated TPU" not in line, line
    sparsecore = re.search(r"programs compiled \(sparsecore (\d+),", line)
    assert sparsecore and int(sparsecore.group(1)) >= 1, line
    assert line.endswith("; 1 device->host copies per step (__main__.main 1)"), line  # the ids stayed on the host


@pytest.mark.slow  # 8 emulated ranks: about 35 s; the mechanism: the v6e-1 test below (about 11 s)
@pytest.mark.multiprocess
def test_the_readmes_rehearsal_runs_the_quickstart_on_the_tpu_path():
    """Issue 63 item 3: README's `tpurec launch --emulate-tpu v5p-16 examples/quickstart.py` ended "nothing ran
    on the emulated TPU (the program's device was not 'tpu')": the example's --device defaulted to cpu."""
    args = _documented_rehearsal()
    assert args == ["--emulate-tpu", "v5p-16", "examples/quickstart.py"]
    own, line = _launch(*args, "--steps", "3", "--batch-size", "512")
    assert own["world_size"] == 8
    _on_the_tpu_path(line, 8, "v5p-16")


@pytest.mark.multiprocess
def test_the_quickstart_takes_an_emulated_ranks_tpu_by_default():
    """The mechanism of the README's rehearsal on one emulated rank (v6e-1): no --device, the TPU path."""
    own, line = _launch("--emulate-tpu", "v6e-1", "examples/quickstart.py", "--steps", "3", "--batch-size", "1024")
    assert own["world_size"] == 1 and own["steps"] == 3
    _on_the_tpu_path(line, 1, "v6e-1")


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
