"""tpurec/emulation/torchtpu_kernels.json: which ops TorchTPU 0.2.0 serves on its device, read from the
wheel's dispatcher registrations (scripts/refresh_torchtpu_kernels.py, in the TorchTPU venv). These
are the facts docs/tpu.md and the emulation rely on; a refresh that changes one fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tpurec.emulation
from tests.torchtpu_venv import NO_TPU_ENV, skip_reason

DATA = Path(tpurec.emulation.__file__).parent / "torchtpu_kernels.json"
GROUPS = ("kernel_ops", "torch_kernel_ops", "composite_ops", "decomposed_ops", "fallback_ops")


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(DATA.read_text())


def group(data: dict, op: str) -> str | None:
    found = [g for g in GROUPS if op in data[g]]
    assert len(found) <= 1, (op, found)
    return found[0] if found else None


def test_the_file_says_how_and_from_what_it_was_made(data):
    assert "refresh_torchtpu_kernels.py" in data["source"] and "_dispatch_dump_table" in data["source"]
    assert data["versions"]["torch-tpu"] == "0.2.0" and data["versions"]["torch"] == "2.14.1"
    for g in GROUPS:
        assert data[g] == sorted(data[g]) and data[g], g


def test_missing_ops_raise_torchtpus_message_and_cpu_fallback_is_off(data):
    fb = data["fallback"]
    assert fb["message"] == "operator '{op}' is not implemented for TPU. Please file a feature request"
    assert fb["privateuse1_backend_fallback"] is True and fb["enable_cpu_fallback_default"] is False
    assert fb["registered_at"] == ["csrc/eager/tpu_aten_kernels.cc:1149"]


@pytest.mark.parametrize(
    "op",
    [
        "aten::index_select",
        "aten::index_add.out",
        "aten::index_copy.out",
        "aten::scatter_add.out",
        "aten::cat.out",
        "aten::nonzero",
        "aten::_unique2",
        "aten::repeat_interleave.Tensor",
        "aten::repeat_interleave.self_int",
        "aten::_embedding_bag",
        "aten::_local_scalar_dense",  # .item()
        "aten::_to_copy",
        "aten::copy_",
        "tpu::_sparse_dense_matmul",
        "tpu::_sparse_dense_matmul_grad_with_adagrad",
    ],
)
def test_ops_with_a_torchtpu_kernel(data, op):
    assert group(data, op) == "kernel_ops"


@pytest.mark.parametrize("op", ["aten::index_add", "aten::cat", "aten::mm", "aten::add.Tensor", "aten::index_copy"])
def test_functional_forms_run_through_their_out_kernel(data, op):
    # torch's CompositeExplicitAutogradNonFunctional kernel: calls `op.out`, which TorchTPU has.
    assert group(data, op) == "composite_ops"


@pytest.mark.parametrize(
    "op",
    [
        "aten::unique_dim",
        "fbgemm::permute_pooled_embs_auto_grad",
        "fbgemm::permute_pooled_embs_auto_grad_split",
        "fbgemm::permute_multi_embedding",
        "fbgemm::regroup_keyed_tensor",
        "fbgemm::batch_index_select_dim0",
        "fbgemm::jagged_2d_to_dense",
        "fbgemm::asynchronous_complete_cumsum",
        "fbgemm::segment_sum_csr",
        "fbgemm::permute_1D_sparse_data",
        "fbgemm::block_bucketize_sparse_features",
        "c10d::monitored_barrier_",
    ],
)
def test_ops_that_reach_the_missing_op_fallback(data, op):
    assert group(data, op) == "fallback_ops"


def test_no_fbgemm_op_has_a_torchtpu_kernel(data):
    assert not [op for op in data["kernel_ops"] + data["torch_kernel_ops"] if op.startswith("fbgemm::")]


@pytest.mark.parametrize("op", ["c10d::allreduce_", "c10d::alltoall_base_", "c10d::_allgather_base_", "c10d::barrier"])
def test_c10d_ops_reach_the_process_group_through_torchs_own_privateuse1_kernel(data, op):
    assert group(data, op) == "torch_kernel_ops"
    assert data["torch_kernel_sources"][op].startswith("torch/csrc/distributed/c10d/Ops.cpp")


def test_autograd_keeps_torchs_kernels_through_a_fallthrough(data):
    assert data["autograd"]["fallback"] == ["fallthrough backend fallback at csrc/eager/tpu_aten_kernels.cc:1220"]
    assert "tpu::_sparse_gather" in data["autograd"]["kernel_ops"]


def test_the_file_is_what_this_venvs_torch_tpu_registers(tmp_path):
    # Only in the TorchTPU venv (scripts/tpu_schema_env.sh): the refresh, run again, changes nothing but the date.
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "kernels.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "refresh_torchtpu_kernels.py"
    env = dict(os.environ, **NO_TPU_ENV, PYTHONWARNINGS="ignore")
    p = subprocess.run(
        [sys.executable, str(script), "--out", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    fresh, kept = json.loads(out.read_text()), json.loads(DATA.read_text())
    fresh.pop("source"), kept.pop("source")
    assert fresh == kept


def test_the_ops_the_v5e_chip_aborts_on_with_its_message(data):
    # a column the dispatcher cannot give: read off a v5e chip (../shared/tpu-vm/README.md); both have kernels
    from tpurec.emulation.device import chip_aborts

    said = "Unsupported conversion from vmreg/vreg to U64"
    assert chip_aborts("v5e") == {"aten::_embedding_bag": said, "aten::_embedding_bag_forward_only": said}
    assert chip_aborts("v5p") == {} and chip_aborts("v6e") == {}
    assert {group(data, op) for op in data["chip_aborts"]["ops"]} == {"kernel_ops"}
