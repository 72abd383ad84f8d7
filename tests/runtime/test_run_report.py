"""`tpurec launch`'s end-of-run checks (tpurec/runtime/run_report.py): what each rank of a user's
program writes when it ends, and the launcher's one line from them."""

from __future__ import annotations

from collections import Counter

import pytest

from tpurec.runtime import host_copies, run_report
from tpurec.runtime.group_watch import WATCH_ENV


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A rank's counters from zero, its launcher's run directory in tmp_path."""
    monkeypatch.setattr(run_report, "_steps", Counter())
    monkeypatch.setattr(run_report, "_step_hooks", [])
    monkeypatch.setattr(run_report, "_providers", [])
    monkeypatch.setattr(host_copies, "_counts", Counter())
    monkeypatch.setenv(WATCH_ENV, str(tmp_path))
    return tmp_path


def test_each_rank_writes_its_steps_and_copies_and_the_launcher_names_the_worst(fresh, monkeypatch):
    seen = []
    run_report.on_step(seen.append)
    for training in (True, True, True, True, False, False):
        run_report.forward(training)
    host_copies._counts.update({"loss": 4, "ids": 2})
    monkeypatch.setenv("RANK", "0")
    run_report.write()
    host_copies._counts.update({"ids": 4})  # rank 1: 2 more copies per step than rank 0
    monkeypatch.setenv("RANK", "1")
    run_report.write()
    assert seen == ["train"] * 4 + ["eval"] * 2
    by_rank = run_report.collect(str(fresh))
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0] == {
        "steps": 4,
        "eval_forwards": 2,
        "device_to_host_copies_per_step": 1.5,
        "device_to_host_copies": {"ids": 2, "loss": 4},
    }
    assert run_report.summary("tpurec launch", by_rank, 1, None) == (
        "tpurec launch: 2 rank(s) on 1 host(s) (TPU), 4 training step(s); programs compiled and recompiles "
        "not measured (TorchTPU 0.2.0 exposes no count); 2.5 device->host copies per step (ids 6, loss 4)"
    )


def test_an_emulated_ranks_figures_replace_tpurecs_own_counts(fresh, monkeypatch):
    programs = {"sparsecore": {"tpu::a": 2, "tpu::b": 2}, "tensorcore": 10, "collective": 3}
    run_report.provide(
        lambda: {
            "programs_compiled": programs,
            "recompiles_after_warmup": 1,
            "recompiled_ops": {"aten::copy_": 1},
            "device_to_host_copies_per_step": 1.0,
            "device_to_host_copies": {"m.f": 8},
        }
    )
    run_report.forward(True)
    monkeypatch.setenv("RANK", "0")
    run_report.write()
    line = run_report.summary("tpurec launch", run_report.collect(str(fresh)), 2, "v5p-16")
    assert line == (
        "tpurec launch: 1 rank(s) on 2 host(s) (emulated v5p-16), 1 training step(s); 17 programs compiled "
        "(sparsecore 4, tensorcore 10, collective 3); 1 recompile(s) after warm-up (aten::copy_); "
        "1 device->host copies per step (m.f 8)"
    )


def test_no_rank_figures_no_line_and_outside_a_launcher_nothing_written(fresh, monkeypatch, tmp_path):
    assert run_report.summary("tpurec launch", {}, 1, None) is None
    monkeypatch.delenv(WATCH_ENV)
    monkeypatch.setenv("RANK", "0")
    run_report.write()
    assert list(tmp_path.iterdir()) == []


def test_compiled_graphs_programs_and_counts_are_in_the_line(fresh, monkeypatch):
    # A rank that trained through torch.compile on the emulated device: its graphs' programs count
    # in the total, and the graphs and breaks Dynamo made are named.
    programs = {"sparsecore": {}, "tensorcore": 2, "collective": 0, "compiled": 5}
    run_report.provide(
        lambda: {
            "programs_compiled": programs,
            "recompiles_after_warmup": 0,
            "device_to_host_copies_per_step": 0.0,
            "device_to_host_copies": {},
            "graphs_compiled": 1,
            "graph_breaks": 0,
        }
    )
    run_report.forward(True)
    monkeypatch.setenv("RANK", "0")
    run_report.write()
    line = run_report.summary("tpurec launch", run_report.collect(str(fresh)), 1, "v5p-8")
    assert line == (
        "tpurec launch: 1 rank(s) on 1 host(s) (emulated v5p-8), 1 training step(s); 7 programs compiled "
        "(sparsecore 0, tensorcore 2, collective 0, from compiled graphs 5); 1 graph(s) compiled, 0 graph break(s); "
        "0 recompile(s) after warm-up; 0 device->host copies per step"
    )


def test_the_handshakes_verdicts_are_in_the_line(fresh, monkeypatch):
    # With TORCH_TPU_SPMD_HANDSHAKE_STAGE set the emulated rank reports its handshakes
    # (tpurec/emulation/handshake.py): how many collective graphs stayed whole, how many were split.
    run_report.provide(
        lambda: {
            "programs_compiled": {"sparsecore": {}, "tensorcore": 0, "collective": 0, "compiled": 1},
            "recompiles_after_warmup": 0,
            "device_to_host_copies_per_step": 0.0,
            "device_to_host_copies": {},
            "graphs_compiled": 1,
            "graph_breaks": 0,
            "handshake_stage": "COMPILE_STAGE",
            "handshakes_agreed": 1,
            "handshakes_split": 0,
        }
    )
    run_report.forward(True)
    monkeypatch.setenv("RANK", "0")
    run_report.write()
    line = run_report.summary("tpurec launch", run_report.collect(str(fresh)), 1, "v5p-8")
    assert "; 1 graph(s) compiled, 0 graph break(s); handshakes (COMPILE_STAGE): 1 agreed, 0 split; 0 recompile" in line
