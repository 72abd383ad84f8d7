"""Faults that need real processes: a rank stopped (SIGSTOP) or killed mid-training, a real full disk
(a small tmpfs), resuming a checkpoint with another model config; and a saved plan of another model
(in this process: a one-rank refusal).
Each asserts the exit code, one line naming what and where, no traceback, and a time bound.

Signals sent to the launcher itself (SIGTERM, SIGKILL) are in tests/runtime/test_lifecycle.py; a rank that
raises and an interrupted checkpoint in tests/dlrm/test_train.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.dlrm.helpers import train, train_here
from tests.helpers.processes import descendants, start_cli
from tests.reliability.inproc import run_cli

SMALL = ["--synth-rows", 30000, "--eval-every", 0, "--curves-out", "none"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's descendants (torch.distributed.run sets RANK)."""
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _start_two_ranks(cache):
    cmd = ["train", "--quiet", "--nproc", 2, *SMALL, "--steps", 100000, "--heartbeat-timeout", 5]
    return start_cli(cmd, env={"TPUREC_CACHE": str(cache)})


def _fault_rank_one(cache, sig) -> tuple[int, str, float]:
    """Start 2 ranks, wait until they train, send rank 1 `sig`; (exit code, stderr, seconds to end)."""
    proc = _start_two_ranks(cache)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        # Rank 0 prints the plan once the model is sharded: both ranks are in the group, beating.
        while time.time() < deadline and proc.poll() is None and not any("tpurec plan:" in x for x in lines):
            time.sleep(0.3)
        pid = _rank_pid(proc.pid, 1)
        assert proc.poll() is None and pid is not None, "".join(lines)[-3000:]
        time.sleep(2)  # into the training steps
        os.kill(pid, sig)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        seconds = time.monotonic() - t0
        reader.join(10)
        return proc.returncode, "".join(lines), seconds
    finally:
        if proc.poll() is None:
            for p in (_rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1), proc.pid):
                if p:
                    os.kill(p, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.multiprocess
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_heartbeat_timeout(cache):
    code, err, seconds = _fault_rank_one(cache, signal.SIGSTOP)
    assert code == 3, err[-3000:]  # EXIT_PEER_SILENT of rank 0, reported by the launcher
    assert (
        "tpurec train: error: rank 0: rank 1 has sent no heartbeat for 5 s (stopped, hung or its host is down); "
        "stopping rank 0 so the job ends" in err
    ), err[-3000:]
    assert "tpurec train: rank 0 exited with code 3" in err
    assert "Traceback" not in err
    assert seconds < 5 + 2 + 5 + 10  # timeout + one beat + torch.distributed.run's shutdown + slack


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_rank_is_named_by_the_launcher_and_the_job_ends(cache):
    code, err, seconds = _fault_rank_one(cache, signal.SIGKILL)
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert "tpurec train: rank 1 was killed by SIGKILL" in err and "stopped the other ranks" in err, err[-3000:]
    assert "Traceback" not in err
    assert seconds < 15


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2.5 MB tmpfs: room for one dlrm-tiny checkpoint (1.5 MB), not two. Needs root."""
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs root to mount a tmpfs; the write-wrapper test covers it")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {mounted.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)


@pytest.mark.slow  # two runs; test_checkpoint_faults.py covers the same path in-process
def test_a_real_full_disk_during_a_save_is_named_and_the_previous_checkpoint_resumes(cache, small_tmpfs):
    root = small_tmpfs / "ck"
    t0 = time.monotonic()
    _, p = train(
        *SMALL, "--steps", 4, "--checkpoint-every", 2, "--keep", 0, "--checkpoint-dir", root, cache=cache, check=False
    )
    assert time.monotonic() - t0 < 120
    assert p.returncode == 2, p.stderr[-3000:]
    assert (
        f"tpurec train: error: rank 0: no space left on device writing {root / 'step-00000004.tmp'}; the previous "
        f"checkpoint {root / 'step-00000002'} is intact. Free space or give another --checkpoint-dir" in p.stderr
    ), p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert sorted(x.name for x in root.iterdir() if x.name.startswith("step-")) == ["step-00000002"]
    result, p = train(*SMALL, "--steps", 3, "--resume", root / "step-00000002", cache=cache)
    assert result["steps"] == 3 and "at step 2, exact" in p.stderr


@pytest.mark.slow  # two runs; the check itself: test_checkpoint_faults.py
def test_resuming_with_another_model_config_is_refused_naming_the_field(cache, tmp_path):
    root = tmp_path / "ck"
    train(*SMALL, "--steps", 2, "--checkpoint-dir", root, cache=cache)
    other = ["--embedding-optimizer", "sgd"]  # the tables' optimizer state would not match
    _, p = train(*SMALL, "--steps", 4, "--checkpoint-dir", root, "--resume", *other, cache=cache, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert (
        f"tpurec train: error: rank 0: resume: {root / 'step-00000002'} was written with embedding_optimizer = "
        "rowwise_adagrad (--embedding-optimizer), this run has sgd: a checkpoint resumes only the model and data "
        "it was written for (give --embedding-optimizer rowwise_adagrad, or start a new run)" in p.stderr
    ), p.stderr[-3000:]
    assert "Traceback" not in p.stderr


def test_a_saved_plan_of_another_model_is_refused_naming_the_file(cache, tmp_path, capsys):
    # both commands in this process (run_cli, train_here): a one-rank refusal needs no process of its
    # own, and two subprocesses cost two imports of torch and TorchRec (most of the test's time)
    plan = tmp_path / "kaggle.json"
    cmd = ["plan", "--model", "criteo-kaggle", "--topology", "cpu-1", "--format", "json", "--out", plan]
    code, _, err = run_cli(cmd, capsys)
    assert code == 0, err
    _, code, err = train_here(capsys, *SMALL, "--steps", 2, "--plan", plan, cache=cache, check=False)
    assert code == 2, err[-3000:]
    assert f"tpurec train: error: rank 0: --plan {plan}, module 'model.sparse_arch.embedding_bag_collection'" in err
    assert "a plan made for another model or other table sizes?" in err and "Traceback" not in err
