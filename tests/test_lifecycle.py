"""Stopping tpurec stops everything it started: signals reach every rank, and children of a killed
process die with it (no rank training on, no converter worker waiting forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _start(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO), **kw.pop("env", {}))
    return subprocess.Popen(
        [sys.executable, "-m", "tpurec.cli", *map(str, args)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _train_ranks_running(proc, tmp_path, cache):
    """Wait until `tpurec train --nproc 2` has its launcher and both ranks; their pids."""
    assert _wait_for(lambda: len(_descendants(proc.pid)) >= 3 or proc.poll() is not None, 240)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    time.sleep(3)  # let the ranks get into training
    return _descendants(proc.pid)


TRAIN = ["train", "--quiet", "--nproc", 2, "--synth-rows", 30000, "--steps", 100000, "--eval-every", 0]


@pytest.mark.multiprocess
def test_sigterm_of_train_nproc_stops_every_rank(tmp_path):
    cache = tmp_path / "cache"
    proc = _start(TRAIN, env={"TPUREC_CACHE": str(cache)})
    try:
        started = _train_ranks_running(proc, tmp_path, cache)
        proc.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: proc.poll() is not None, 60), "launcher did not stop"
        assert _wait_for(lambda: not any(_alive(p) for p in started), 60), [p for p in started if _alive(p)]
        assert proc.returncode != 0
    finally:
        for p in [proc.pid, *_descendants(proc.pid)]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_of_train_nproc_takes_the_ranks_with_it(tmp_path):
    cache = tmp_path / "cache"
    proc = _start(TRAIN, env={"TPUREC_CACHE": str(cache)})
    started = _train_ranks_running(proc, tmp_path, cache)
    proc.kill()
    proc.wait()
    assert _wait_for(lambda: not any(_alive(p) for p in started), 60), [p for p in started if _alive(p)]


def test_sigkill_of_data_convert_takes_its_workers_with_it(tmp_path):
    from tpurec.bench.data import write_criteo_tsv

    inputs = []
    for i in range(2):
        path = tmp_path / f"day_{i}"
        write_criteo_tsv(str(tmp_path), str(path), 400_000, seed=i)
        inputs.append(path)
    proc = _start(["data", "convert", *inputs, "--out", tmp_path / "out", "--jobs", 2, "--quiet"])
    try:
        # Killed as soon as both workers exist: a fixed wait let a quiet host finish the conversion first.
        assert _wait_for(lambda: len(_descendants(proc.pid)) >= 2 or proc.poll() is not None, 60)
        workers = _descendants(proc.pid)
        assert proc.poll() is None, "the conversion finished before it could be killed; use larger inputs"
        proc.kill()
        proc.wait()
        assert _wait_for(lambda: not any(_alive(p) for p in workers), 30), [p for p in workers if _alive(p)]
    finally:
        for p in _descendants(proc.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
