"""Ctrl-C is one line saying what was left, exit 130, on every process (issue #29, family 7).

Before, a Ctrl-C printed KeyboardInterrupt tracebacks: during a save, on every rank of `--nproc 2`,
in `data convert --jobs 2` and its workers. In-process cases send this process a real SIGINT from
inside the work (so `tpurec.cli.main`'s handler is the one that runs); the real process groups a
terminal signals (ranks, converter workers) are the subprocess cases at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.processes import descendants, wait_for
from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli
from tpurec.runtime import interrupts, stop_request

REPO = Path(__file__).resolve().parents[2]


def _ctrl_c() -> None:
    """What a terminal's Ctrl-C does to this process (its handler runs at the next bytecode). Only
    under tpurec's handler: pytest's own would stop the whole session."""
    assert interrupts.installed() or stop_request.installed(), (
        "no tpurec Ctrl-C handler in place: the command would print a traceback"
    )
    os.kill(os.getpid(), signal.SIGINT)


def _interrupting(monkeypatch, owner, name: str, calls: int = 1) -> None:
    """Ctrl-C on the `calls`-th call of `owner.name` (a module's function or a class's method),
    which then runs as usual."""
    original = getattr(owner, name)
    seen = []

    def wrapper(*a, **k):
        seen.append(1)
        if len(seen) == calls:
            _ctrl_c()
        return original(*a, **k)

    monkeypatch.setattr(owner, name, wrapper)


def _save_step(where: str) -> tuple[object, str]:
    """(owner, name) of a step of a checkpoint save: sealing it, or DCP writing its shards."""
    if where == "sealing":
        from tpurec.dlrm.ckpt import integrity

        return integrity, "write_checksums"
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter, "write_data"


@pytest.mark.parametrize("where", ["sealing", "inside_dcp"])
def test_ctrl_c_during_a_save_names_the_last_complete_checkpoint(checkpoints, monkeypatch, capsys, where):
    """The save of step 6 is interrupted: one line naming step 4, its .tmp removed."""
    _interrupting(monkeypatch, *_save_step(where))
    code, out, err = run_cli(
        [*TINY_TRAIN, "--steps", 8, "--checkpoint-every", 2, "--checkpoint-dir", checkpoints, "--resume"], capsys
    )
    step4 = checkpoints / "step-00000004"
    assert_refused(
        code,
        err,
        f"tpurec train: interrupted at step 6 (rank 0); the last complete checkpoint is step 4 ({step4})",
        exit_code=130,
        prefix="tpurec train: ",
    )
    assert out == "" and sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000004"]


def test_ctrl_c_during_training_without_checkpoints_says_nothing_was_saved(tiny_cache, monkeypatch, capsys):
    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    from tpurec.dlrm.trainer import Trainer

    _interrupting(monkeypatch, Trainer, "_read_loss", calls=2)
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 50], capsys)
    # a Ctrl-C while training stops it at the next logged step, once the batches in flight are trained
    # (tpurec/runtime/stop_request.py): step 3 and the two batches TorchRec's pipeline holds
    says = "tpurec train: stopped by Ctrl-C at step 5; nothing saved (no --checkpoint-dir)"
    assert_refused(code, err, says, exit_code=130, prefix="tpurec train: ")


def test_ctrl_c_of_any_command_is_one_line(monkeypatch, capsys):
    from tpurec.planner import report as plan_report

    _interrupting(monkeypatch, plan_report, "plan_tables")
    code, out, err = run_cli(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4"], capsys)
    assert_refused(code, err, "tpurec plan: interrupted", exit_code=130)
    assert err.strip() == "tpurec plan: interrupted" and out == ""


def test_ctrl_c_of_data_synth_writes_nothing(tmp_path, monkeypatch, capsys):
    from tpurec.data import synth

    _interrupting(monkeypatch, synth, "generate_chunk", calls=2)
    code, _, err = run_cli(["data", "synth", "--rows", 3000, "--row-group-size", 1000, "--out", tmp_path / "o"], capsys)
    assert_refused(code, err, f"tpurec data: interrupted; nothing written to {tmp_path / 'o'}", exit_code=130)
    assert list((tmp_path / "o").iterdir()) == []


def test_a_ctrl_c_during_deferred_steps_comes_after_them_and_a_relayed_one_is_ignored():
    """A checkpoint's marker and renames (or a dataset's) run as one step; the copy of the signal
    that torch.distributed.run relays right after the terminal's does not interrupt the unwinding."""
    done = []
    with interrupts.handled():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                _ctrl_c()
                time.sleep(0.01)  # the handler has run by now, and held the interrupt back
                done.append("renamed")
        assert done == ["renamed"] and interrupts.interrupted()
        _ctrl_c()  # the relayed copy: no second KeyboardInterrupt while the first unwinds
        time.sleep(0.01)
    with interrupts.handled():
        assert not interrupts.interrupted()  # the next command starts afresh


# ----- real process groups: what a terminal's Ctrl-C reaches ------------------------------------------


def _start(argv: list, env: dict | None = None) -> subprocess.Popen:
    """`tpurec ARGV` in a process group of its own, as a shell runs a foreground job."""
    return subprocess.Popen(
        [sys.executable, "-m", "tpurec.cli", *map(str, argv)],
        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _read_stderr(proc: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True).start()
    return lines


@pytest.mark.slow  # spawns two workers that import pyarrow (about 15 s on a loaded 2-core host)
def test_ctrl_c_of_convert_jobs_2_is_one_line_from_the_converter_and_none_from_its_workers(tmp_path):
    from tpurec.bench.data import write_criteo_tsv

    days = [tmp_path / f"day_{i}" for i in range(2)]
    for i, day in enumerate(days):
        write_criteo_tsv(str(tmp_path), str(day), 300_000, seed=i)
    out = tmp_path / "out"
    proc = _start(["data", "convert", *days, "--out", out, "--jobs", 2])
    try:
        # Interrupted once both workers write their parts.
        assert wait_for(lambda: len(list(out.glob("*.tmp-*"))) == 2 or proc.poll() is not None, 120)
        assert proc.poll() is None, "the conversion ended before it could be interrupted; use larger inputs"
        workers = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the converter and its workers
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip() == f"tpurec data: interrupted; nothing written to {out}"
    assert list(out.iterdir()) == []
    assert wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), 30)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_of_train_nproc_2_during_a_save_is_one_line_naming_the_ranks(tmp_path):
    root = tmp_path / "ck"
    argv = [*TINY_TRAIN[:1], "--quiet", "--nproc", 2, "--synth-rows", 30000, "--steps", 100000, "--eval-every", 0]
    proc = _start(
        [*argv, "--curves-out", "none", "--checkpoint-dir", root, "--checkpoint-every", 1, "--keep", 2],
        env={"TPUREC_CACHE": str(tmp_path / "cache")},
    )
    lines = _read_stderr(proc)
    try:
        assert wait_for(lambda: any("checkpoint:" in x for x in lines) or proc.poll() is not None, 300)
        time.sleep(0.3)  # into the next steps and saves
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    err = "".join(lines)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    said = sorted(x for x in err.splitlines() if "interrupted" in x)
    stopped = [x for x in err.splitlines() if x.startswith("tpurec train: stopped by Ctrl-C at step ")]
    if stopped:  # it landed in a training step, not a save: the agreed stop (tests/reliability/test_stop_by_signal.py)
        assert len(stopped) == 1 and not said, err[-3000:]
        assert not list(root.glob("*.tmp"))
        return
    # once, naming both ranks (was: a line per rank); two lines only if the ranks stopped at other steps
    if len(said) == 1:
        assert said[0].startswith("tpurec train: ranks 0-1: interrupted at step "), err[-3000:]
    else:
        assert [x[:21] for x in said] == ["tpurec train: rank 0:", "tpurec train: rank 1:"], err[-3000:]
    assert "; the last complete checkpoint is step " in said[0]
    assert not list(root.glob("*.tmp"))  # the save that was under way left nothing behind


def test_the_ranks_stop_for_the_largest_signal_any_rank_got(monkeypatch):
    """`StopRequest.agreed` over 3 ranks, the all-reduce faked with the other ranks' signals: each rank
    stops for the largest (a signal on one rank stops them all); 1 rank asks no collective."""
    import torch.distributed as dist

    others: list[int] = []
    ops: list = []

    def all_reduce(flag, op):
        ops.append(op)
        values = [int(flag[0]), *others]
        flag[0] = max(values) if op == dist.ReduceOp.MAX else min(values) if op == dist.ReduceOp.MIN else sum(values)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    request = stop_request.StopRequest()
    for mine, others[:], want in ((0, [0, 0], 0), (0, [2, 15], 15), (2, [0, 0], 2), (15, [2, 0], 15)):
        request.signum = mine
        assert request.agreed(3) == want, (mine, others)
    assert ops == [dist.ReduceOp.MAX] * 4
    request.signum = 15
    assert request.agreed(1) == 15 and len(ops) == 4
