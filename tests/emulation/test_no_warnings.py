"""Launched and emulated runs print no warning that tpurec triggers (issue #41): an emulated launch
printed, per rank, TorchRec's `broadcast_buffers` FutureWarning (attributed to the emulated DDP's
__init__, past the filter keyed on TorchRec's module), `torch.jit.script`'s FutureWarning (tpurec
imported TorchRec's hash_mc_modules to look for a HashZch module), DCP's "deprecating ShardedTensor"
FutureWarning at every save and load of a DMP's state dict, and DDP's C++ "Time stats are currently
only collected for CPU and CUDA devices" on the TPU device. Each is avoided or filtered at its
source (tpurec/sharding/dmp.py, tpurec/sharding/mc_sharder.py); a user's own warnings still print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# a Python warning's first line ("...: FutureWarning: ..."), its source line ("  warnings.warn("),
# and torch's C++ warnings ("[W1204 ...] Warning: ..." / "[rank0]:[W...")
WARNING = re.compile(r"Warning\b|warnings\.warn\(|^\s*(\[rank\d+\]:)?\[W\d{4} ")


def _run(args: list[str], tmp_path: Path) -> str:
    env = dict(os.environ, TPUREC_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("PYTHONWARNINGS", None)
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args], env=env, capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if WARNING.search(line)]


@pytest.mark.slow  # 4 emulated ranks: about 45 s; 8 (the count, v5p-16): about 60 s
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "slice_name,device",
    [("v5p-8", ["--device", "cpu"]), ("v5p-8", []), ("v5p-16", ["--device", "cpu"])],
    ids=["cpu_model", "tpu_model", "cpu_model_8_ranks"],
)
def test_an_emulated_launch_of_the_quickstart_prints_no_warning(tmp_path, slice_name, device):
    err = _run(["launch", "--emulate-tpu", slice_name, "examples/quickstart.py", "--quick", *device], tmp_path)
    assert _warnings(err) == [], err[-3000:]


@pytest.mark.slow  # 4 emulated ranks: about 45 s
@pytest.mark.multiprocess
def test_an_emulated_training_run_prints_no_warning(tmp_path):
    err = _run(
        ["train", "--emulate-tpu", "v5p-8", "--steps", "2", "--synth-rows", "5000", "--curves-out", "none"], tmp_path
    )
    assert _warnings(err) == [], err[-3000:]


def test_the_sharded_tensor_filter_spares_the_users_own_warnings():
    """The filters are for tpurec's and its libraries' calls: the same words from a program's own
    module still print."""
    import warnings

    from tpurec.sharding.dmp import _quiet_sharded_tensor_notice

    said = "Please use DTensor instead and we are deprecating ShardedTensor."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_sharded_tensor_notice()
        warnings.warn_explicit(
            said, FutureWarning, "planner_helpers.py", 1, "torch.distributed.checkpoint.planner_helpers"
        )
        warnings.warn_explicit(said, FutureWarning, "train.py", 1, "__main__")
        warnings.warn_explicit("mine, deprecated", FutureWarning, "train.py", 2, "__main__")
    assert [(str(w.message), w.filename) for w in seen] == [(said, "train.py"), ("mine, deprecated", "train.py")]


def test_no_ddp_runtime_stats_on_the_tpu_device_and_the_rest_of_the_logger_is_torchs():
    from tpurec.sharding.dmp import _NoRuntimeStats

    calls = []

    class Logger:
        def set_runtime_stats_and_log(self):
            calls.append("stats")

        def _get_ddp_logging_data(self):
            return {"world_size": 4}

    quiet = _NoRuntimeStats(Logger())
    quiet.set_runtime_stats_and_log()
    assert calls == [] and quiet._get_ddp_logging_data() == {"world_size": 4}
