"""`tpurec train --emulate-tpu v5p-8 --step compiled|pipelined` (issue #42): the steps behind
`--step` on the emulated TPU path, torch.compile's backend "tpu" (tpurec/emulation/compiled.py),
against `--step eager` on the same slice, plan, limits and seed."""

from __future__ import annotations

import os

import pytest

from tests.dlrm.helpers import train
from tpurec.cli import main

ROWS = 20_000
STEPS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """`tpurec train`'s synthetic data (seed 3) in its own cache, the planner's v5p-8 plan for dlrm-tiny
    and the limits `tpurec data stats` measures on that data for that plan."""
    from tpurec.dlrm import data

    root = tmp_path_factory.mktemp("emulated_step")
    old = os.environ.get("TPUREC_CACHE")
    os.environ["TPUREC_CACHE"] = str(root)
    try:
        synth = data.ensure_synth("dlrm-tiny", ROWS, 3, say=lambda _: None)
    finally:
        if old is None:
            del os.environ["TPUREC_CACHE"]
        else:
            os.environ["TPUREC_CACHE"] = old
    plan, limits = root / "P.json", root / "L.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--format", "json", "--out", str(plan)]) == 0
    assert main(["data", "stats", str(synth), "--model", "dlrm-tiny", "--plan", str(plan), "--out", str(limits)]) == 0
    return root, plan, limits


def _run(setup, step: str, handshake: str | None = None) -> tuple[dict, str]:
    root, plan, limits = setup
    args: tuple[object, ...] = ("--step", step, "--dense-optimizer", "sgd", "--plan", plan, "--limits", limits)
    args += ("--curves-out", "none", "--synth-rows", ROWS, "--steps", STEPS, "--eval-every", STEPS, "--seed", 3)
    saved = os.environ.pop("TORCH_TPU_SPMD_HANDSHAKE_STAGE", None)
    if handshake:
        os.environ["TORCH_TPU_SPMD_HANDSHAKE_STAGE"] = handshake
    try:
        result, p = train("--emulate-tpu", "v5p-8", *args, cache=root, timeout=1200)
    finally:
        os.environ.pop("TORCH_TPU_SPMD_HANDSHAKE_STAGE", None)
        if saved is not None:
            os.environ["TORCH_TPU_SPMD_HANDSHAKE_STAGE"] = saved
    assert result is not None and result["step"] == step and result["world_size"] == 4
    return result, p.stderr


@pytest.mark.slow  # two 4-rank emulated runs: about 40 s
@pytest.mark.multiprocess
def test_emulated_compiled_step_is_one_graph_and_equals_eager(setup):
    eager, _ = _run(setup, "eager")
    compiled, err = _run(setup, "compiled")
    assert "--step compiled: the steady step runs under torch.compile" in err
    assert "input pipeline" not in err  # the step preprocesses itself: no input pipeline to report
    # one graph per rank, no break, nothing compiled after warm-up; the graph's programs (its stretches
    # between collectives, SplitCompiler's cut) counted with the device's own
    assert compiled["graphs_compiled"] == 1 and compiled["graph_breaks"] == 0
    assert compiled["recompiles_after_warmup"] == 0 and compiled["recompiled_ops"] == {}
    assert compiled["programs_compiled"]["compiled"] >= 2 and eager["programs_compiled"]["compiled"] == 0
    assert eager["graphs_compiled"] == 0
    assert compiled["device_to_host_copies_per_step"] <= 1.0, compiled["device_to_host_copies"]
    # The same numbers: the graph runs the eager kernels (the emulated backend is aot_eager's
    # execution), and its per-gradient all-reduce of grad/world sums each element over the ranks in
    # the same order as DDP's bucketed one (DDP also divides before it reduces).
    assert (compiled["auc"], compiled["logloss"]) == (eager["auc"], eager["logloss"])


@pytest.mark.slow  # two 4-rank emulated runs: about 40 s
@pytest.mark.multiprocess
def test_emulated_pipelined_step_is_one_graph_and_trains(setup):
    eager, _ = _run(setup, "eager")
    pipelined, _ = _run(setup, "pipelined")
    # the steady step is one graph on every rank; its SparseCore forward runs tpurec::fused_lookup
    # under no_grad (a plain lookup's TPU kernel reaches TorchTPU's op, which has no fake to trace)
    assert pipelined["graphs_compiled"] == 1 and pipelined["graph_breaks"] == 0
    # after warm-up only the drain's eager table updates are new programs (the last two batches'
    # SparseCore backward, run eagerly once the data ends, as TorchRec's drain does): compiled once there
    assert set(pipelined["recompiled_ops"]) <= {"tpurec::fused_update"}, pipelined["recompiled_ops"]
    assert pipelined["programs_compiled"]["compiled"] >= 2
    # not the eager numbers: the tables are one step stale (docs/dmp.md "Pipelined step"); the same
    # data and model, so the held-out figures stay close
    assert pipelined["auc"] != eager["auc"]
    assert abs(pipelined["auc"] - eager["auc"]) < 0.02 and abs(pipelined["logloss"] - eager["logloss"]) < 0.02


@pytest.mark.slow  # two 4-rank emulated runs: about 40 s
@pytest.mark.multiprocess
def test_under_the_compile_stage_handshake_the_planners_plan_steps_as_one_program(setup):
    """The planner's v5p-8 plan gives each rank table-wise tables of other sizes, so the measured limits
    of a rank's stack differ from the others' and with them the graph's code; with TorchTPU's handshake
    on, DMP raises every rank's limits to the largest (tpurec/sharding/rank_limits.py), the ranks' graphs
    agree and the step is one program with its collectives inside, training as the split one does."""
    split, _ = _run(setup, "compiled")
    whole, _ = _run(setup, "compiled", handshake="COMPILE_STAGE")
    assert "handshake_stage" not in split  # unset: OFF, nothing handshaken, every collective graph split
    assert (whole["handshake_stage"], whole["handshakes_agreed"], whole["handshakes_split"]) == ("COMPILE_STAGE", 1, 0)
    assert whole["programs_compiled"]["compiled"] == 1 and split["programs_compiled"]["compiled"] >= 2
    assert whole["graphs_compiled"] == 1 and whole["recompiles_after_warmup"] == 0
    assert (whole["auc"], whole["logloss"]) == (split["auc"], split["logloss"])
