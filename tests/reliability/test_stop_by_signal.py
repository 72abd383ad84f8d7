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
from tests.reliability.inproc import TINY_TRAIN, run_cli
from tpurec.runtime import stop_request

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


# default suite time: 13 s here; the stop's parts stay: SIGTERM in a save, an evaluation, the final save
# (below, in this process), Ctrl-C in a step (test_interrupts.py), resumes (tests/dlrm/test_keep_best.py)
@pytest.mark.slow
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


# ----- SIGTERM outside a training step (issue #61 item 3), in this process --------------------------


def _sigterm_on_call(monkeypatch, owner, name: str, calls: int = 1) -> None:
    """SIGTERM to this process on the `calls`-th call of `owner.name`, which then runs as usual.
    Only under a StopRequest's handler: the default action would end the test session itself."""
    original = getattr(owner, name)
    seen = []

    def wrapper(*a, **k):
        seen.append(1)
        if len(seen) == calls:
            handler = signal.getsignal(signal.SIGTERM)
            assert isinstance(getattr(handler, "__self__", None), stop_request.StopRequest), (
                f"SIGTERM is not handled during {name} (handler {handler!r}): it would kill the process"
            )
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # its handler runs here, inside the work
        return original(*a, **k)

    monkeypatch.setattr(owner, name, wrapper)


def _stopped(err: str, step: int, ck) -> None:
    """One line: stopped at `step` with checkpoint step-`step` written, and the --resume command."""
    found = STOPPED.findall(err)
    assert len(found) == 1 and "Traceback" not in err, err
    what, at, saved, command = found[0]
    assert (what, int(at), saved) == ("SIGTERM", step, str(ck / f"step-{step:08d}")), err
    assert shlex.split(command)[-1] == "--resume"


def test_sigterm_during_a_periodic_save_finishes_it_and_stops_there(tiny_cache, tmp_path, monkeypatch, capsys):
    """The save of step 4 is under way (sealing it): it completes, and the run stops at step 4 with
    it as the checkpoint to resume (was: the process killed, rc -15, its .tmp left, no line)."""
    from tpurec.dlrm.ckpt import integrity

    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    ck = tmp_path / "ck"
    _sigterm_on_call(monkeypatch, integrity, "write_checksums", calls=2)
    argv = [*TINY_TRAIN, "--steps", 8, "--checkpoint-every", 2, "--checkpoint-dir", ck]
    code, out, err = run_cli(argv, capsys)
    assert code == 143, err
    _stopped(err, 4, ck)
    assert out == "" and sorted(p.name for p in ck.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert (ck / "step-00000004" / "COMPLETE").exists()


def test_sigterm_during_an_evaluation_stops_after_it_with_a_checkpoint(tiny_cache, tmp_path, monkeypatch, capsys):
    """The evaluation at step 3 runs to its end, then the run saves step 3 and stops there."""
    from tpurec.dlrm.trainer import Trainer

    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    ck = tmp_path / "ck"
    _sigterm_on_call(monkeypatch, Trainer, "evaluate")
    argv = [*TINY_TRAIN, "--steps", 9, "--eval-every", 3, "--checkpoint-every", 100, "--checkpoint-dir", ck]
    code, out, err = run_cli([*argv, "--metrics-out", tmp_path / "m.csv"], capsys)
    assert code == 143, err
    _stopped(err, 3, ck)
    assert out == "" and sorted(p.name for p in ck.glob("step-*")) == ["step-00000003"]
    with open(tmp_path / "m.csv") as f:
        evals = [int(r["step"]) for r in csv.DictReader(f) if r["kind"] == "eval"]
    assert evals == [3]  # the evaluation under way finished and was recorded; no later one ran


def test_sigterm_during_the_final_save_stops_before_the_final_evaluation(tiny_cache, tmp_path, monkeypatch, capsys):
    from tpurec.dlrm.ckpt import integrity

    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    ck = tmp_path / "ck"
    _sigterm_on_call(monkeypatch, integrity, "write_checksums")
    code, out, err = run_cli([*TINY_TRAIN, "--steps", 4, "--checkpoint-dir", ck], capsys)
    assert code == 143, err
    _stopped(err, 4, ck)
    assert out == "" and sorted(p.name for p in ck.glob("step-*")) == ["step-00000004"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_a_two_rank_job_saving_every_step_is_one_line_naming_a_complete_checkpoint(tmp_path, cache):
    """Saves fill most of the run, so the relayed SIGTERM lands in one (was: rc 143, no line, the
    ranks killed mid-save); in a training step the agreed stop gives the same line."""
    ck = tmp_path / "ck"
    args = ["--quiet", "--nproc", "2", "--synth-rows", "30000", "--steps", "100000", "--eval-every", "0"]
    p, err = _start(
        [*args, "--curves-out", "none", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"], tmp_path, cache
    )
    try:
        deadline = time.monotonic() + 300
        while "checkpoint:" not in (tmp_path / "stderr.txt").read_text() and p.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        time.sleep(0.3)  # into the next saves
        p.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler does; it relays it to the ranks
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        err.close()
    text = (tmp_path / "stderr.txt").read_text()
    assert code == 143, text[-3000:]
    found = STOPPED.findall(text)
    assert len(found) == 1 and "Traceback" not in text, text[-3000:]
    what, step, saved, _ = found[0]
    assert what == "SIGTERM" and saved == str(ck / f"step-{int(step):08d}"), text[-3000:]
    assert (ck / f"step-{int(step):08d}" / "COMPLETE").exists() and not list(ck.glob("*.tmp"))


SLOW_BUILD = """
import importlib.util, os, pathlib, time

spec = importlib.util.spec_from_file_location("my_model", {example!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

def build():  # the model is being built when the SIGTERM comes
    pathlib.Path(os.environ["TPUREC_TEST_BUILDING"]).touch()
    time.sleep(120)
    return example.build()
"""


def test_sigterm_while_the_model_is_built_ends_the_run_in_one_line(tmp_path):
    """SIGTERM before the training loop (here: inside the --model-module's FN) used to end the process
    by the signal's default action: rc -15, no line. Now: one line naming what is saved, exit 143."""
    from tpurec.cli import main

    example = str(REPO / "examples" / "my_model.py")
    data = tmp_path / "data"
    assert main(["data", "synth", "--model-module", f"{example}:build", "--rows", "2000", "--out", str(data)]) == 0
    (tmp_path / "slow.py").write_text(SLOW_BUILD.format(example=example))
    marker, ck = tmp_path / "building", tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=str(REPO), TPUREC_TEST_BUILDING=str(marker), TPUREC_CACHE=str(tmp_path))
    args = ["--model-module", f"{tmp_path / 'slow.py'}:build", "--data", data, "--checkpoint-dir", ck, "--steps", 5]
    p = subprocess.Popen(
        [sys.executable, "-m", "tpurec.cli", "train", "--quiet", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143, err[-3000:]
    assert "Traceback" not in err and out == ""
    assert err.strip().splitlines()[-1] == f"tpurec train: stopped by SIGTERM (rank 0); no complete checkpoint in {ck}"
    assert not list(ck.glob("step-*"))
