"""`tpurec train --emulate-tpu SLICE`: a TPU slice's ranks, grouped into hosts, on this machine's CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dlrm.helpers import REPO, train

ROWS = 60_000
# every sharding type the planner offers on a TPU: TW, CW, TWCW, RW
EVERY_SHARDING_TYPE = ("--model-module", "tests.emulation.every_sharding_type:dlrm_tiny", "--batch-size", "512")


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
@pytest.mark.multiprocess
def test_emulated_single_host_slice_trains_on_the_tpu_path(tmp_path):
    result, _ = train("--emulate-tpu", "v5p-8", "--steps", 3, "--synth-rows", ROWS, "--seed", 3, cache=tmp_path)
    assert result["world_size"] == 4 and result["hosts"] == 1 and result["emulated_tpu"] == "v5p-8"
    # One lookup and one update program per stack, none new after warm-up, counted over every op the
    # emulated device ran (tpurec/emulation/device.py): SparseCore, TensorCore and collective programs.
    programs = result["programs_compiled"]
    sparsecore = programs["sparsecore"]
    assert sparsecore["tpu::_sparse_dense_matmul"] >= 1
    assert sparsecore["tpu::_sparse_dense_matmul_grad_with_adagrad"] == sparsecore["tpu::_sparse_dense_matmul"]
    assert programs["tensorcore"] > 50 and programs["collective"] >= 1  # the dense model, the all-to-alls
    assert result["recompiles_after_warmup"] == 0 and result["recompiled_ops"] == {}
    # the trainer's step is eager: nothing traced, no compiled-graph program
    assert result["graphs_compiled"] == 0 and result["graph_breaks"] == 0 and programs["compiled"] == 0
    assert result["dense"] == "eager"  # an emulated TPU compiles the dense modules only when asked
    assert result["uneven_all_to_all"] == "padded"
    # The ids stay on the host from the reader to preprocessing: the only device->host copy of a step
    # after warm-up is the loss, read at each progress point (every step in a 3-step run). Before, the
    # input all-to-all ran on the device and every lookup copied its ids back. Warm-up: DDP's bucket
    # rebuild in step 2 copies its bucket sizes to the host.
    assert result["device_to_host_copies"] == {"tpurec.dlrm.trainer._read_loss": 1}
    assert result["device_to_host_copies_per_step"] == 1.0
    assert result["device_to_host_copies_in_warmup"]["tpurec.dlrm.trainer._read_loss"] == 2


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
@pytest.mark.multiprocess
def test_ranks_on_the_tpu_path_without_torchtpus_launch_env_fail_as_torchtpu_does(tmp_path, monkeypatch):
    # A plain torchrun-style launch (what docs/tpu_vm.md used to recommend) of TPU ranks.
    monkeypatch.setenv("TPUREC_EMULATE_TPU", "v5p-8")
    _, p = train("--nproc", 2, "--steps", 1, "--synth-rows", ROWS, cache=tmp_path, check=False)
    assert p.returncode != 0
    assert "missing required environment variables for distributed training" in p.stderr


def _plan(tmp_path, *how, topology: str = "v5p-16") -> Path:
    plan = tmp_path / "P.json"
    subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "plan", *how, "--topology", topology, "--format", "json", "--out", plan],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
    )
    return plan


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "how",
    [
        ("--model", "dlrm-tiny"),  # the planner's own choice: table-column-wise, table-wise, row-wise
        EVERY_SHARDING_TYPE,
    ],
)
def test_two_host_emulation_equals_cpu_gloo_on_the_same_plan(tmp_path, how, monkeypatch):
    """The acceptance run: v5p-16 (8 ranks on 2 hosts) vs 8 CPU ranks, one plan, one seed."""
    # The CPU ranks on the SparseCore layout path, the arithmetic the emulated TPU runs (the direct
    # CPU step sums in another order: logloss 4e-5 apart after 20 steps).
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    args = ("--plan", _plan(tmp_path, *how), "--steps", 20, "--seed", 3, "--synth-rows", ROWS)
    emulated, _ = train("--emulate-tpu", "v5p-16", *args, cache=tmp_path, timeout=1200)
    # the CPU ranks' DDP in the emulated device's graph mode (see the bit-for-bit test below)
    dynamic = Path(__file__).parent / "ddp_dynamic_graph"
    cpu, _ = train("--nproc", 8, *args, cache=tmp_path, timeout=1200, pythonpath=[dynamic])
    assert emulated["world_size"] == cpu["world_size"] == 8
    assert emulated["hosts"] == 2 and cpu["hosts"] == 1
    assert emulated["recompiles_after_warmup"] == 0
    assert emulated["device_to_host_copies_per_step"] == 1.0  # the loss: the ids never went to the device
    assert abs(emulated["logloss"] - cpu["logloss"]) <= 1e-5
    assert abs(emulated["auc"] - cpu["auc"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_embedding_collection_model_on_two_emulated_hosts_equals_cpu_gloo():
    """examples/sequential_recommender.py (an EmbeddingCollection) through `tpurec launch`, on the
    emulated device (`--device tpu`: the example's default is the CPU)."""
    script = [str(REPO / "examples" / "sequential_recommender.py"), "--steps", "30"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TPUREC_NO_DIRECT="1")  # as above

    def last_json(cmd):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    launch = [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-16"]
    emulated = last_json([*launch, *script, "--device", "tpu"])
    # the CPU ranks' DDP in the emulated device's graph mode (see the bit-for-bit test below): without
    # it the gloo sums of the dense gradients are ordered otherwise (AUC 0.6146 vs 0.6139, session 32)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "ddp_dynamic_graph"), str(REPO)])
    cpu = last_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", *script])
    assert emulated["world_size"] == cpu["world_size"] == 8
    for key in ("first_loss", "last_loss", "auc"):
        assert emulated[key] == cpu[key], key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_embedding_collection_model_on_the_emulated_tpu_device_compiles_nothing_after_warmup():
    """examples/sequential_recommender.py --device tpu on v5p-8 (#36 items 4 and 7): the sequence outputs
    stay on the device (a host recat used to carry them off it, and backward met a device mismatch), no
    program is first compiled after warm-up, one device->host copy per step (the loss), and the losses
    and AUC equal 4 CPU gloo ranks'."""
    script = [str(REPO / "examples" / "sequential_recommender.py"), "--steps", "30"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TPUREC_NO_DIRECT="1")

    def last_json(cmd):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    emulated = last_json(
        [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-8", *script, "--device", "tpu"]
    )
    # the CPU ranks' DDP in the emulated device's graph mode (see the bit-for-bit test below)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "ddp_dynamic_graph"), str(REPO)])
    cpu = last_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *script])
    assert emulated["world_size"] == cpu["world_size"] == 4
    assert emulated["recompiles_after_warmup"] == 0
    assert emulated["device_to_host_copies_per_step"] == 1.0
    for key in ("first_loss", "last_loss", "last_step_loss", "auc"):  # the last at full precision
        assert emulated[key] == cpu[key], key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_emulated_ranks_equal_cpu_gloo_bit_for_bit_when_ddp_runs_in_the_same_graph_mode(tmp_path, monkeypatch):
    """The emulated device's only arithmetic difference from CPU gloo ranks is DDP's graph mode: it runs
    `static_graph=False` (docs/tpu.md, "DDP"), which buckets the dense gradients in another order from
    step 2, so gloo sums them in another order (1e-8 apart at step 2; a 40-step run that overfits 20k
    rows amplified that to 8e-3 in logloss). With CPU ranks in the same mode, every step's loss is equal."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")  # the CPU ranks on the layout path, as above
    plan = _plan(tmp_path, "--model", "dlrm-tiny", topology="v5p-8")
    args = ("--plan", plan, "--steps", 40, "--eval-every", 10, "--seed", 3, "--synth-rows", 20_000)
    emulated, _ = train("--emulate-tpu", "v5p-8", *args, "--metrics-out", tmp_path / "emu.csv", cache=tmp_path)
    dynamic = Path(__file__).parent / "ddp_dynamic_graph"  # its sitecustomize: static_graph=False
    cpu, _ = train("--nproc", 4, *args, "--metrics-out", tmp_path / "cpu.csv", cache=tmp_path, pythonpath=[dynamic])

    def losses(name: str) -> list[str]:
        rows = [line.split(",") for line in (tmp_path / name).read_text().splitlines()[1:]]
        return [r[5] for r in rows if r[0] == "train"]

    assert len(losses("emu.csv")) == 40
    assert losses("emu.csv") == losses("cpu.csv")
    assert emulated["logloss"] == cpu["logloss"] and emulated["auc"] == cpu["auc"]


@pytest.mark.slow  # 8 ranks twice
@pytest.mark.multiprocess
def test_an_emulated_v5e_8_runs_the_tensorcore_kernel_and_equals_cpu_gloo(tmp_path, monkeypatch):
    """v5e has no SparseCore: its 8 ranks run the TensorCore kernel's TPU kernels (JAX programs through
    the stand-in of TorchTPU's JAX bridge) on a layout of one SparseCore per device; the CPU ranks run
    the reference on the same plan and layout. Same seed, same numbers within 1e-5."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")  # the CPU ranks on the layout path, as above
    plan = _plan(tmp_path, "--model", "dlrm-tiny", topology="v5e-8")
    args = ("--plan", plan, "--steps", 20, "--seed", 3, "--synth-rows", 20_000)
    emulated, _ = train("--emulate-tpu", "v5e-8", *args, cache=tmp_path, timeout=1200)
    dynamic = Path(__file__).parent / "ddp_dynamic_graph"  # the CPU ranks' DDP in the device's graph mode
    cpu, _ = train("--nproc", 8, *args, cache=tmp_path, timeout=1200, pythonpath=[dynamic])
    assert emulated["world_size"] == cpu["world_size"] == 8 and emulated["emulated_tpu"] == "v5e-8"
    programs = emulated["programs_compiled"]
    assert programs["sparsecore"] == {} and programs["tensorcore"] > 50  # no SparseCore op was asked for
    assert emulated["recompiles_after_warmup"] == 0
    assert abs(emulated["logloss"] - cpu["logloss"]) <= 1e-5
    assert abs(emulated["auc"] - cpu["auc"]) <= 1e-5
