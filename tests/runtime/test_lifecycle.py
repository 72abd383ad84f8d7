"""Stopping tpurec stops everything it started: signals reach every rank, and children of a killed
process die with it (no rank training on, no converter worker waiting forever)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.processes import alive, descendants, start_cli, wait_for


def _train_ranks_running(proc, tmp_path, cache):
    """Wait until `tpurec train --nproc 2` has its launcher and both ranks; their pids."""
    assert wait_for(lambda: len(descendants(proc.pid)) >= 3 or proc.poll() is not None, 240)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    time.sleep(3)  # let the ranks get into training
    return descendants(proc.pid)


TRAIN = ["train", "--quiet", "--nproc", 2, "--synth-rows", 30000, "--steps", 100000, "--eval-every", 0]


@pytest.mark.multiprocess
def test_sigterm_of_train_nproc_stops_every_rank(tmp_path):
    cache = tmp_path / "cache"
    proc = start_cli(TRAIN, env={"TPUREC_CACHE": str(cache)})
    try:
        started = _train_ranks_running(proc, tmp_path, cache)
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: proc.poll() is not None, 60), "launcher did not stop"
        assert wait_for(lambda: not any(alive(p) for p in started), 60), [p for p in started if alive(p)]
        assert proc.returncode != 0
    finally:
        for p in [proc.pid, *descendants(proc.pid)]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_of_train_nproc_takes_the_ranks_with_it(tmp_path):
    cache = tmp_path / "cache"
    proc = start_cli(TRAIN, env={"TPUREC_CACHE": str(cache)})
    started = _train_ranks_running(proc, tmp_path, cache)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(p) for p in started), 60), [p for p in started if alive(p)]


def test_sigkill_of_data_convert_takes_its_workers_with_it(tmp_path):
    from tpurec.bench.data import write_criteo_tsv

    inputs = []
    for i in range(2):
        path = tmp_path / f"day_{i}"
        write_criteo_tsv(str(tmp_path), str(path), 400_000, seed=i)
        inputs.append(path)
    proc = start_cli(["data", "convert", *inputs, "--out", tmp_path / "out", "--jobs", 2, "--quiet"])
    try:
        # Killed as soon as both workers exist: a fixed wait let a quiet host finish the conversion first.
        assert wait_for(lambda: len(descendants(proc.pid)) >= 2 or proc.poll() is not None, 60)
        workers = descendants(proc.pid)
        assert proc.poll() is None, "the conversion finished before it could be killed; use larger inputs"
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not any(alive(p) for p in workers), 30), [p for p in workers if alive(p)]
    finally:
        for p in descendants(proc.pid):
            if alive(p):
                os.kill(p, signal.SIGKILL)
