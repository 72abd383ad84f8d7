"""The compiled DMP step on the emulated TPU device (issue #42): `CompiledStep` under TorchTPU's
backend ("tpu", tpurec/emulation/compiled.py) traces a whole training step of a model whose tables,
dense parameters and batch tensors are on the device, with no graph break, and trains as the eager
step does (docs/kernels.md "Compiled step").

The oracle is TorchRec's eager step of a twin DMP built from the same seed on the same device and
batches (DMP's forward, DDP, torch.optim.SGD), run through the device op by op. The compiled graph
runs the same kernels on the same numbers in the same order (the backend runs it as aot_eager does,
on the CPU data under the device tensors; the eager TPU adapter's TorchTPU stand-in computes with the
same CPU reference the compiled lookup op calls), so losses, tables and dense weights are asserted
bit-equal. Each rank runs tests/emulation/compiled_step_program.py, which writes its figures as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("compiled_step_program.py")
STEPS = 20


def _assert_trains_as_eager(seen: dict, tol: float = 0.0) -> None:
    assert seen["same_start"]
    assert len(seen["eager"]) == STEPS
    assert seen["compiled"] == pytest.approx(seen["eager"], abs=tol, rel=0)  # tol 0: bit for bit, every step
    assert seen["table_diff"] <= tol and seen["dense_diff"] <= tol
    assert seen["tables_moved"] > 1e-3  # every table shard moved: the fused updates ran in the graph
    assert seen["dense_on_device"]
    # one graph for all steps, no break (torch._dynamo's counters, the emulated result line's figures)
    assert seen["graphs_compiled"] == 1 and seen["graph_breaks"] == 0


def _one_rank(tmp_path: Path, *args: str, fails: bool = False) -> Any:
    """The program as the only rank of an emulated v6e-1 (one chip, one host: world 1)."""
    from tpurec.emulation.launch_env import _unused_port, emulated_launch_env
    from tpurec.planner.topology import parse_slice

    env = dict(os.environ, **emulated_launch_env(parse_slice("v6e-1"))[0])
    env.update(
        TPUREC_EMULATE_TPU="v6e-1",
        LOCAL_RANK="0",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_unused_port()),
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    out = tmp_path / "seen"
    done = subprocess.run(
        [sys.executable, str(PROGRAM), "--out", str(out), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if fails:  # the run's error output
        assert done.returncode != 0
        return done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "seen.rank0.json").read_text())


def _v5p_8(tmp_path: Path, model: str, oracle: str, **env_vars: str) -> tuple[list[dict], str]:
    """The program on every rank of an emulated v5p-8 (`tpurec launch`): each rank's JSON, the launcher's
    error output (its end-of-run line)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env_vars)
    launch = [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-8"]
    done = subprocess.run(
        [*launch, str(PROGRAM), "--model", model, "--oracle", oracle, "--out", str(tmp_path / "seen")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"seen.rank{r}.json").read_text()) for r in range(4)], done.stderr


def test_compiled_dmp_step_on_the_emulated_device_is_one_graph_and_equals_eager(tmp_path):
    seen = _one_rank(tmp_path, "--host-tensor-check")
    assert seen["world"] == 1 and seen["plan"] == ["table_wise"]
    _assert_trains_as_eager(seen)
    explained = seen["explain"]
    assert explained["graphs"] == 1 and explained["breaks"] == 0, explained["reasons"]
    # The device counts the graph as one program (no collective at one rank: nothing to split it on),
    # first asked for by the first compiled step; later steps ask for nothing new: the ops traced
    # into the graph were not run, and so not counted, one by one.
    assert seen["graphs"] == 1 and len(seen["compiled_programs"]) == 1 and seen["graph_collectives"] == []
    # (and the copy of the update's scalars into the kernel's step feed, one each step before the
    # graph: SparseCoreKernel.begin_compiled_step, step_scalars.py)
    assert sorted(seen["new_programs_by_step"][0]) == [
        ["compiled", seen["compiled_programs"][0][0]],
        ["tensorcore", "aten::copy_"],
    ]
    assert all(new == [] for new in seen["new_programs_by_step"][1:])
    # The device's rules hold while tracing: dense features left on the host fail the trace at the
    # first op that mixes them with the device's weights, as the eager step would fail there.
    error = seen["host_tensor_error"]
    assert error is not None and "found at least two devices, tpu:0 and cpu" in error, error
    assert "got a host tensor of shape (32, 5)" in error


def test_a_host_tier_table_trains_as_eager_in_the_compiled_step_on_the_emulated_device(tmp_path):
    """Table t0 on the host tier (half its rows cached in the device's memory): CompiledStep's host half
    maps each batch's ids to cache slots, loading and evicting rows, before the one graph runs; the
    update's step count and scalars begun eagerly (step_scalars.py). Bit for bit the eager step's."""
    seen = _one_rank(tmp_path, "--model", "small-host")
    _assert_trains_as_eager(seen)
    (counters,) = seen["host_tier"].values()
    assert counters["hits"] > 0 and counters["misses"] > 0 and counters["evictions"] > 0
    assert len(seen["compiled_programs"]) == 1 and seen["explain"]["breaks"] == 0, seen["explain"]["reasons"]


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
def test_two_sharded_ebcs_compile_to_one_program_on_the_emulated_device(tmp_path):
    """Two sharded EBCs fed a KJT field each (step_inputs.py): on the device, one graph, one program
    asked for by the first step, and the eager step's numbers bit for bit."""
    seen = _one_rank(tmp_path, "--model", "two-ebcs")
    assert seen["world"] == 1
    _assert_trains_as_eager(seen)
    assert seen["explain"]["graphs"] == 1 and seen["explain"]["breaks"] == 0, seen["explain"]["reasons"]
    assert len(seen["compiled_programs"]) == 1 and all(new == [] for new in seen["new_programs_by_step"][1:])


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.parametrize("model", ["seq", "seq-mask"])
def test_an_embedding_collection_model_compiles_to_one_program_on_the_emulated_device(tmp_path, model):
    """A sharded EC (its fixed-shape path, the device's default) beside a sharded EBC
    (tests/helpers/sequence_model.py's model), each sequence pooled by its total (no lengths read)
    or by a mask built from the output's offsets, which are on the device beside `values()` (as TorchRec
    gives them on a GPU): one graph, one program asked for by the first step, the eager step's numbers."""
    seen = _one_rank(tmp_path, "--model", model)
    _assert_trains_as_eager(seen)
    assert seen["explain"]["graphs"] == 1 and seen["explain"]["breaks"] == 0, seen["explain"]["reasons"]
    assert len(seen["compiled_programs"]) == 1 and all(new == [] for new in seen["new_programs_by_step"][1:])


@pytest.mark.slow  # four ranks, two dlrm-tiny DMPs each: 35 s, minutes on a loaded host
@pytest.mark.multiprocess
@pytest.mark.parametrize("oracle", ["allreduce", "ddp"])
def test_compiled_dlrm_tiny_on_every_emulated_rank_of_a_v5p_8_plan_with_every_sharding_type(tmp_path, oracle):
    ranks, _ = _v5p_8(tmp_path, "dlrm-tiny", oracle)
    for rank, seen in enumerate(ranks):
        assert seen["world"] == 4, rank
        # every sharding type the planner offers on a TPU (tests/emulation/every_sharding_type.py)
        assert seen["plan"] == ["column_wise", "row_wise", "table_column_wise", "table_wise"], rank
        # Against an eager step that averages the dense gradients in one bucket with one all-reduce, as
        # the graph does: bit for bit. Against DDP's step within 1e-6: DDP's buckets are others, and
        # gloo's sum of four ranks' float32 values comes out in another order (of two it cannot: two
        # gloo ranks are bit-equal, tests/sharding/test_compiled_dmp_step.py); one all-reduce per
        # gradient, as the graph had before dense_update.py, also differs by 6e-8 in one loss of 20.
        _assert_trains_as_eager(seen, tol=0.0 if oracle == "allreduce" else 1e-6)
        assert seen["explain"]["graphs"] == 1 and seen["explain"]["breaks"] == 0, seen["explain"]["reasons"]
        # In the graph, as TorchTPU's backend splits it: the output dist's all-to-alls and the dense
        # gradients' all-reduce, each a collective program between the compiled stretches.
        assert seen["graph_collectives"] == [
            "_c10d_functional::all_reduce",
            "_c10d_functional::all_to_all_single",
        ], rank
        assert len(seen["compiled_programs"]) >= 2, rank
        # the dense gradients' one bucket (one per gradient: 37 programs per run, not 19)
        assert seen["all_reduces_per_run"] == [1], rank


@pytest.mark.slow  # four ranks, two DMPs each: 50 s a case
@pytest.mark.multiprocess
@pytest.mark.parametrize("model, agreed", [("small", True), ("dlrm-tiny", False)])
def test_under_the_compile_stage_handshake_a_plan_whose_ranks_trace_one_graph_stays_one_program(
    tmp_path, model, agreed
):
    """TORCH_TPU_SPMD_HANDSHAKE_STAGE=COMPILE_STAGE (emulation/handshake.py): the small model's plan (a
    table of equal shape on each rank) traces the same step on every rank, which the handshake keeps
    one program, its all-to-alls inside; dlrm-tiny's plan of every sharding type gives each rank
    other shards (other lookups, split sizes and views), so its graph is split at every collective as
    with the handshake off. Either way the step trains bit for bit as the eager one."""
    ranks, err = _v5p_8(tmp_path, model, "allreduce", TORCH_TPU_SPMD_HANDSHAKE_STAGE="COMPILE_STAGE")
    assert f"handshakes (COMPILE_STAGE): {int(agreed)} agreed, {int(not agreed)} split" in err
    for rank, seen in enumerate(ranks):
        _assert_trains_as_eager(seen)
        assert (seen["handshakes_agreed"], seen["handshakes_split"]) == (int(agreed), int(not agreed)), rank
        programs = seen["programs_per_run"]
        if agreed:
            assert programs == [{"compiled": 1}], rank
        else:
            assert programs[0]["collective"] >= 2 and programs[0]["compiled"] >= 2, rank


def test_a_graph_is_split_into_programs_at_its_collectives_as_torchtpu_splits_it():
    """emulation/compiled.py's count, against a graph counted by hand: three stretches of computation
    and two collectives; a collective's wait_tensor goes with it, and two collectives in a row have no
    stretch between them."""
    import torch

    from tpurec.emulation.compiled import graph_programs

    funcol = torch.ops._c10d_functional

    def step(x):
        a = funcol.wait_tensor(funcol.all_reduce(x * 2, "sum", "0"))
        b = funcol.wait_tensor(funcol.all_to_all_single(a + 1, [2, 2], [2, 2], "0"))
        c = funcol.wait_tensor(funcol.all_reduce(b, "avg", "0"))
        return c * 3

    gm = torch.fx.symbolic_trace(step)
    programs = graph_programs(gm, [torch.ones(4)], forward=True)
    assert [kind for kind, _, _ in programs] == [
        "compiled",
        "collective",
        "compiled",
        "collective",
        "collective",
        "compiled",
    ]
    assert [op for kind, op, _ in programs if kind == "collective"] == [
        "_c10d_functional::all_reduce",
        "_c10d_functional::all_to_all_single",
        "_c10d_functional::all_reduce",
    ]
    stretches = [key for kind, _, key in programs if kind == "compiled"]
    assert [s[:2] for s in stretches] == [("forward", 0), ("forward", 1), ("forward", 2)]
    assert all(s[2] == (((4,), "torch.float32"),) for s in stretches)  # keyed by the graph's input shapes


def test_graph_counts_count_graphs_and_breaks():
    """The result line's `graphs_compiled` and `graph_breaks` (torch._dynamo's counters) on a function
    with one break: two graphs, one break."""
    import torch

    from tpurec.emulation.compiled import graph_counts

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        assert graph_counts() == {"graphs_compiled": 0, "graph_breaks": 0}
        assert torch.equal(torch.compile(broken, backend="eager")(torch.ones(3)), torch.full((3,), 3.0))
        assert graph_counts() == {"graphs_compiled": 2, "graph_breaks": 1}
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
