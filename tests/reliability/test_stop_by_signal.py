"""SIGTERM (a preempted VM, a scheduler) or Ctrl-C during `tpurec train`: the ranks agree on a step,
the pipeline drains, a final checkpoint is written with the metrics and curves, and one line gives
the `--resume` command; the resumed run continues the metrics with no step twice."""

from __future__ import annotations

import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import IO

import pytest

from tests.dlrm.helpers import REPO

STOPPED = re.compile(
    r"^tpurec train: stopped by (SIGTERM|Ctrl-C) at step (\d+); checkpoint (\S+) written; resume with: (.+)$", re.M
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def _start(args: list[str], tmp_path, cache) -> tuple[subprocess.Popen, IO[str]]:
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    err = open(tmp_path / "stderr.txt", "w")
    p = subprocess.Popen(
        [sys.executable, "-m", "tpurec.cli", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        cwd=REPO,
        start_new_session=True,  # its own process group: a Ctrl-C reaches the whole job, as from a terminal
    )
    return p, err


def _wait_for_progress(tmp_path, p: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(r"^step \d+/\d+: loss", (tmp_path / "stderr.txt").read_text(), re.M):
            return
        assert p.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError("no progress line")


def _stop_and_resume(tmp_path, cache, launch: list[str], sig: int, group: bool) -> None:
    ck, metrics = tmp_path / "ck", tmp_path / "m.csv"
    common = ["--synth-rows", "30000", "--eval-every", "0", "--checkpoint-dir", str(ck), "--metrics-out", str(metrics)]
    p, err = _start([*launch, "--steps", "5000", *common], tmp_path, cache)
    _wait_for_progress(tmp_path, p)
    if group:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    code = p.wait(timeout=180)
    err.close()
    text = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + sig, text[-3000:]
    found = STOPPED.findall(text)
    assert len(found) == 1, text[-3000:]  # one line, not one per rank
    what, step, saved, command = found[0]
    assert what == ("SIGTERM" if sig == signal.SIGTERM else "Ctrl-C")
    assert saved == str(ck / f"step-{int(step):08d}") and (ck / f"step-{int(step):08d}" / "meta.json").exists()
    assert "Traceback" not in text
    with open(metrics) as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r["kind"] == "train"]
    assert steps and steps[-1] <= int(step) < 5000
    assert (tmp_path / "m.png").exists()

    # the command printed resumes it (fewer steps to go, so the test ends soon)
    words = shlex.split(command)
    assert words[:2] == ["tpurec", "train"] and words[-1] == "--resume"
    words[words.index("--steps") + 1] = str(int(step) + 40)
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *words[1:], "--quiet"], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {step}, exact" in done.stderr
    with open(metrics) as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == int(step) + 40  # no step twice, a monotone curve


@pytest.mark.multiprocess
def test_sigterm_stops_one_process_run_at_a_step_with_a_checkpoint_and_the_resume_command(tmp_path, cache):
    _stop_and_resume(tmp_path, cache, [], signal.SIGTERM, group=False)


@pytest.mark.slow  # two launches of 2 ranks: about a minute
@pytest.mark.multiprocess
def test_ctrl_c_to_a_two_rank_job_stops_every_rank_at_one_step(tmp_path, cache):
    _stop_and_resume(tmp_path, cache, ["--nproc", "2"], signal.SIGINT, group=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_of_a_two_rank_job(tmp_path, cache):
    _stop_and_resume(tmp_path, cache, ["--nproc", "2"], signal.SIGTERM, group=False)
