"""Sizes without bounds (issue #29 item 3): every size a user gives is checked up front against the
host (memory, free disk) or a stated maximum, and refused in one line naming the flag, the value and
the bound, before anything is written; SIGTERM during synthesis leaves no temporary file.

Before: `data synth --rows 10**20` and `train --synth-rows 10**11` started writing (the rows' oracle
probabilities alone would need terabytes of memory), `plan --topology cpu-100000` and a 3,000-table
file planned for minutes or hours, and SIGTERM (whose default ends the process at once) left the
temporary parts of a synthetic dataset behind. Planning time itself is measured, not tested here
(docs/results.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli

REPO = Path(__file__).resolve().parents[2]


def test_data_synth_rows_beyond_memory_are_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli(["data", "synth", "--rows", 10**20, "--out", out], capsys)
    says = "tpurec data: error: --rows 100,000,000,000,000,000,000: making them needs about"
    assert_refused(code, err, says)
    assert "bytes per row" in err and "available: at most" in err
    assert not out.exists()


def test_data_synth_rows_beyond_the_free_disk_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(2**62))  # memory no bound: the disk is
    out = tmp_path / "o"
    code, _, err = run_cli(["data", "synth", "--rows", 10**14, "--out", out], capsys)
    assert_refused(code, err, "tpurec data: error: --rows 100,000,000,000,000: about")
    assert "of Parquet (" in err and f"but {out} has" in err and "free: at most" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "table_set,rows",
    [
        ("dlrm-tiny", 140_000),
        ("criteo-kaggle", 140_000),
        # its large tables' dictionaries make whole row groups 13% bigger per row than the sample
        ("mlperf-dcnv2", 140_000),  # about 5 s
    ],
)
def test_the_disk_bound_for_synthetic_data_never_underestimates_it(tmp_path, monkeypatch, table_set, rows):
    """Written for real (more than two row groups of 65,536 rows), the dataset is no larger than the
    bound: a disk with one byte less free than it took is refused."""
    from tpurec.data import synth_bounds
    from tpurec.data.synth import synthesize

    out = tmp_path / "o"
    synthesize(rows, str(out), table_set=table_set, show_progress=False)
    took = sum(f.stat().st_size for f in out.iterdir())
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(2**62))  # memory no bound: the disk is
    monkeypatch.setattr(synth_bounds, "free_disk_bytes", lambda path: took - 1)
    said = synth_bounds.rows_problem("--rows", rows, tmp_path / "next", table_set)
    assert said is not None and "of Parquet (" in said, (took, said)


def test_train_synth_rows_beyond_memory_are_refused_before_any_data_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli([*TINY_TRAIN, "--synth-rows", 10**11, "--steps", 1], capsys)
    assert_refused(code, err, "tpurec train: error: --synth-rows 100,000,000,000: making them needs about")
    assert not (tmp_path / "cache").exists()


# ----- SIGTERM while synthetic data is written ---------------------------------------------------------
def _sigterm_on(monkeypatch, owner, name: str, calls: int) -> None:
    """SIGTERM to this process on the `calls`-th call of `owner.name`, which then runs as usual. Only
    under tpurec's handler: the default action would end the test session."""
    outside = signal.getsignal(signal.SIGTERM)
    original = getattr(owner, name)
    seen = []

    def wrapper(*a, **k):
        seen.append(1)
        if len(seen) == calls:
            assert signal.getsignal(signal.SIGTERM) is not outside, "no SIGTERM handler: the process would just die"
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*a, **k)

    monkeypatch.setattr(owner, name, wrapper)


def test_sigterm_during_data_synth_removes_its_temporary_parts(tmp_path, monkeypatch, capsys):
    from tpurec.data import synth

    outside = signal.getsignal(signal.SIGTERM)
    _sigterm_on(monkeypatch, synth, "generate_chunk", calls=2)
    out = tmp_path / "o"
    code, _, err = run_cli(["data", "synth", "--rows", 3000, "--row-group-size", 1000, "--out", out], capsys)
    assert code == 128 + signal.SIGTERM  # as a shell reports a process SIGTERM ended
    # one line saying what stopped and what was removed (there was none before)
    assert err.splitlines() == [
        f"tpurec data synth: stopped by SIGTERM; nothing written to {out}, its 1 temporary part(s) removed"
    ]
    assert list(out.iterdir()) == []  # no part-00000.parquet.tmp-PID (nor the lock)
    assert signal.getsignal(signal.SIGTERM) is outside


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_train_makes_its_synthetic_data_removes_the_temporary_directory(tmp_path, monkeypatch, sig):
    from tpurec.data import synth
    from tpurec.dlrm.data import ensure_synth
    from tpurec.runtime import interrupts
    from tpurec.runtime.terminate import Terminated

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path))
    if sig == "SIGTERM":
        _sigterm_on(monkeypatch, synth, "generate_chunk", calls=1)
        with pytest.raises(Terminated):
            ensure_synth("dlrm-tiny", 3000, 1, say=lambda m: None)
    else:  # Ctrl-C, under the handler every tpurec command runs in
        original = synth.generate_chunk
        monkeypatch.setattr(synth, "generate_chunk", lambda *a: (os.kill(os.getpid(), signal.SIGINT), original(*a))[1])
        with interrupts.handled(), pytest.raises(KeyboardInterrupt):
            ensure_synth("dlrm-tiny", 3000, 1, say=lambda m: None)
    assert list(tmp_path.iterdir()) == []  # no .synth-dlrm-tiny-3000-1.tmp-* directory


# ----- planning ------------------------------------------------------------------------------------------
def _tables_file(path, n: int):
    path.write_text(json.dumps([{"name": f"t{i}", "rows": 1000, "dim": 16} for i in range(n)]))
    return path


PLANS = [
    ("cpu-100000", ["--model", "dlrm-tiny", "--topology", "cpu-100000"],
     "tpurec plan: --topology: 'cpu-100000': 100,000 CPU ranks; tpurec plans at most 18,432 devices, those of the "
     "largest Cloud TPU slice (v7x-9216"),
    ("2xv7x-9216", ["--model", "dlrm-tiny", "--topology", "2xv7x-9216"],
     "tpurec plan: --topology: '2xv7x-9216': 36,864 devices in all; tpurec plans at most 18,432 devices"),
    ("5,000 tables", ["--tables", 5000, "--topology", "v5p-8"], ": 5,000 tables; tpurec plans at most 4,096"),
    ("600 tables on 18,432 devices", ["--tables", 600, "--topology", "v7x-9216"],
     ": 600 tables on 18,432 devices; tpurec plans at most 524,288 tables x devices (at most 28 tables on 18,432"),
]  # fmt: skip


@pytest.mark.parametrize("case,args,says", PLANS, ids=[c[0] for c in PLANS])
def test_plans_larger_than_tpurec_plans_are_refused_at_once(tmp_path, capsys, case, args, says):
    args = [
        _tables_file(tmp_path / "tables.json", a) if i and args[i - 1] == "--tables" else a for i, a in enumerate(args)
    ]
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", *args, "--format", "json", "--out", out], capsys)
    assert_refused(code, err, says)
    assert not out.exists()


def test_plan_size_refusals_come_before_torch_is_imported(tmp_path):
    """The one line comes before the heavy imports (well under a second of work)."""
    tables = _tables_file(tmp_path / "tables.json", 5000)
    code = (
        "import sys; from tpurec.cli import main; "
        "a = main(['plan', '--model', 'dlrm-tiny', '--topology', 'cpu-100000']); "
        f"b = main(['plan', '--tables', {str(tables)!r}, '--topology', 'v5p-8']); "
        "print('RC', a, b, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "RC 2 2 False" in p.stdout, (p.stdout, p.stderr)


class _Option:
    """What the budget reads of a TorchRec ShardingOption: its shards."""

    def __init__(self, shards: int) -> None:
        self.shards = [None] * shards


class _Endless:
    """A proposer that never runs out of proposals of 10 shards each."""

    def load(self, search_space, enumerator=None) -> None:
        self.made = 0

    def propose(self):
        self.made += 1
        return [_Option(10)]

    def feedback(self, partitionable, plan=None, perf_rating=None, storage_constraint=None) -> None:
        pass


@pytest.mark.parametrize("fits", [True, False])
def test_a_proposer_stops_at_its_shard_budget(fits):
    """Once a plan fits, a proposer stops after `budget` shards; before, after NO_FIT_FACTOR budgets,
    and the search then says it reached its bound (planner.plan: SearchBoundReached, not "does not fit")."""
    from tpurec.planner.proposal_budget import NO_FIT_FACTOR, bound_reached, budgeted

    (p,) = budgeted([_Endless()], budget=100)
    p.load([])
    while (proposal := p.propose()) is not None:
        p.feedback(partitionable=fits, plan=proposal if fits else None)
    assert p.inner.made == (10 if fits else 10 * NO_FIT_FACTOR)
    assert bound_reached([p]) is not fits
