"""Errors a rank finds are printed once, with the ranks that found them (issue #41), and a killed or
Ctrl-C'd emulated run ends in one line leaving no process behind.

Before: every rank printed its copy of the same error (8 lines on v5p-16; a UserError raised in a
`tpurec launch` program was a traceback per rank), a Ctrl-C of `tpurec launch` printed a
KeyboardInterrupt traceback per rank (out of the middle of `import torch` when it came early), and the
agent's line on a killed rank of `tpurec launch` said `tpurec train`. Real ranks throughout: a plain
torchrun of `python -m tpurec.dlrm`, `tpurec launch --emulate-tpu v5p-8` (4 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tpurec.launch.agent import summary
from tpurec.runtime import group_watch, rank_errors

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)


def test_ranks_are_named_in_ranges():
    assert rank_errors.ranks_text([3]) == "rank 3"
    assert rank_errors.ranks_text([7, 0, 1, 2, 3, 4, 5, 6]) == "ranks 0-7"
    assert rank_errors.ranks_text([5, 0, 2, 6, 7]) == "ranks 0, 2, 5-7"


def test_the_launcher_prints_each_distinct_line_once_with_its_ranks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(group_watch.WATCH_ENV, str(tmp_path))
    for rank, message in [(2, "bad --plan"), (0, "bad --plan"), (1, "bad --plan"), (3, "disk full")]:
        monkeypatch.setenv("RANK", str(rank))
        rank_errors.report("tpurec train: error", message)
    assert capsys.readouterr().err == ""  # the ranks say nothing themselves
    assert rank_errors.collect(str(tmp_path)) == [
        "tpurec train: error: ranks 0-2: bad --plan",
        "tpurec train: error: rank 3: disk full",
    ]
    assert rank_errors.reported(str(tmp_path)) == {0, 1, 2, 3}


def test_the_agents_line_leaves_out_ranks_that_said_their_error(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank: int, code: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        f.timestamp = 7
        return f

    failures = {0: failure(0, 2), 1: failure(1, -signal.SIGTERM)}
    assert summary(failures, "tpurec launch", {0}) == ("", 2)  # rank 1 was only stopped
    failures[1] = failure(1, -signal.SIGKILL)
    line, code = summary(failures, "tpurec launch", {0})
    assert line == "tpurec launch: rank 1 was killed by SIGKILL; torch.distributed.run stopped the other ranks"
    assert code == 2


@pytest.mark.multiprocess
def test_under_plain_torchrun_an_error_every_rank_finds_is_printed_once(tmp_path):
    missing = tmp_path / "no-plan.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "tpurec.dlrm", "--synth-rows", "2000", "--steps", "1", "--plan", str(missing)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    said = [line for line in p.stderr.splitlines() if "file not found" in line]
    assert p.returncode != 0, p.stderr[-3000:]
    assert len(said) == 1, p.stderr[-3000:]  # was: one copy per rank
    assert said[0].startswith("tpurec train: error: rank ") and said[0].endswith(f"--plan {missing}: file not found")
    # torchrun's own report of the failed ranks (its ChildFailedError traceback) is not tpurec's to change
    assert "tpurec/dlrm/" not in p.stderr  # no rank's traceback


TAG = "TPUREC_TEST_RUN_TAG"  # in the environment of every process of a launch: how its leftovers are found


def _launch(tmp_path: Path, script: str, *flags: str, **popen) -> subprocess.Popen:
    (tmp_path / "prog.py").write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-8", *flags, "prog.py"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=_env(**{TAG: str(tmp_path)}), text=True, **popen)


def _processes_of(tmp_path: Path) -> list[psutil.Process]:
    """Every live process started by the launch (its tag in their environment), wherever they are now."""
    found = []
    for q in psutil.process_iter():
        try:
            if q.environ().get(TAG) == str(tmp_path) and q.status() != psutil.STATUS_ZOMBIE:
                found.append(q)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _rank_processes(tmp_path: Path) -> list[psutil.Process]:
    """The launch's ranks (run_script processes, not the agent, whose command names it too)."""
    found = []
    for q in _processes_of(tmp_path):
        try:
            cmd = q.cmdline()
        except psutil.Error:
            continue
        if "tpurec.runtime.run_script" in cmd and "tpurec.launch.agent" not in cmd:
            found.append(q)
    return found


def _ended(tmp_path: Path, within: float) -> list[str]:
    """The launch's processes still alive after `within` seconds (their command lines)."""
    end = time.monotonic() + within
    while _processes_of(tmp_path) and time.monotonic() < end:
        time.sleep(0.2)
    return [" ".join(q.cmdline()) for q in _processes_of(tmp_path)]


@pytest.mark.slow  # a 4-rank launch, ~40 s: the default suite's 2-rank torchrun case covers the dedup
@pytest.mark.multiprocess
def test_a_user_error_raised_on_every_rank_of_a_launch_is_one_line(tmp_path):
    p = _launch(
        tmp_path,
        """
        from tpurec.errors import UserError
        raise UserError("id_limits['t'] max_ids_per_partition: 0 is not a whole number")
        """,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    # was: a UserError traceback per rank, then the agent's line on 4 failed ranks
    assert lines == ["tpurec launch: error: ranks 0-3: id_limits['t'] max_ids_per_partition: 0 is not a whole number"]


SLEEPER = """
    import os, subprocess, sys, time
    if os.environ["RANK"] == "0":
        subprocess.Popen(["sleep", "300"])  # a process of the program's own: it goes with the run
    print("up", os.environ["RANK"], flush=True)
    time.sleep(300)
"""


def _ranks_up(launcher: subprocess.Popen, deadline: float = 180) -> list[psutil.Process]:
    """The launch's processes once every rank runs the program (each printed `up`)."""
    assert launcher.stdout is not None
    seen: set[str] = set()
    start = time.monotonic()
    while len(seen) < 4:
        assert time.monotonic() - start < deadline, "the ranks did not start"
        line = launcher.stdout.readline()
        if line.startswith("up "):
            seen.add(line.split()[1])
    time.sleep(0.5)  # rank 0's own child started before it printed
    return psutil.Process(launcher.pid).children(recursive=True)


@pytest.mark.slow  # 4 emulated ranks: 20-40 s
@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_launch_in_one_line_leaving_no_process(tmp_path):
    p = _launch(tmp_path, SLEEPER, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs = _ranks_up(p)
    ranks = [q for q in procs if "prog.py" in q.cmdline() and "tpurec.launch.agent" not in q.cmdline()]
    assert len(ranks) == 4 and any(q.cmdline()[:2] == ["sleep", "300"] for q in procs)
    victim = sorted(ranks, key=lambda q: q.pid)[1]
    start = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert p.returncode == 128 + signal.SIGKILL, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tpurec launch: rank "), err[-3000:]  # was: `tpurec train: `
    assert " was killed by SIGKILL" in lines[0]
    assert _ended(tmp_path, 10) == []


@pytest.mark.slow  # 4 emulated ranks: 20-40 s
@pytest.mark.multiprocess
@pytest.mark.parametrize("early", [True, False], ids=["while_starting", "while_running"])
def test_ctrl_c_of_a_launch_ends_every_rank_in_one_line(tmp_path, early):
    p = _launch(tmp_path, SLEEPER, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if early:  # the ranks are importing torch: was a KeyboardInterrupt traceback out of it per rank
        end = time.monotonic() + 120
        while len(_rank_processes(tmp_path)) < 4 and time.monotonic() < end:
            time.sleep(0.1)
        assert len(_rank_processes(tmp_path)) == 4
        time.sleep(1)  # into `import torch` (seconds)
    else:
        _ranks_up(p)
    start = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert p.returncode == 130, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "tpurec launch: interrupted; every rank of the run was stopped"
    ], err[-3000:]
    assert _ended(tmp_path, 10) == []


@pytest.mark.multiprocess
def test_a_program_that_never_returns_is_stopped_at_the_timeout_leaving_no_process(tmp_path):
    start = time.monotonic()
    p = _launch(tmp_path, SLEEPER, "--timeout", "5", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    assert time.monotonic() - start < 5 + 30  # the bound, torch.distributed.run's 5 s shutdown, slack
    assert p.returncode == 124, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["tpurec launch: error: the program ran past --timeout 5 s; stopped every rank"], err[-3000:]
    assert _ended(tmp_path, 10) == []


@pytest.mark.slow  # 4 emulated ranks: 20-40 s
@pytest.mark.multiprocess
def test_a_rank_exiting_non_zero_ends_the_launch_in_one_line(tmp_path):
    script = SLEEPER.replace('print("up"', 'sys.exit(3) if os.environ["RANK"] == "2" else print("up"')
    p = _launch(tmp_path, script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 3, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tpurec launch: rank 2 exited with code 3"), err[-3000:]
    assert lines[0].endswith("; torch.distributed.run stopped the other ranks")
    assert _ended(tmp_path, 10) == []
