"""The package installs, imports light, and its command answers."""

import json
import subprocess
import sys

import pytest
import torch

import tpurec
from tpurec import cli
from tpurec.runtime import device


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tpurec.cli", *args], capture_output=True, text=True, timeout=120)


def test_import_does_not_load_tpu_or_jax():
    code = (
        "import tpurec, sys; bad=[m for m in sys.modules if m.startswith(('jax','torch_tpu','libtpu'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_and_help_list_only_registered_commands():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"tpurec {tpurec.__version__}"
    help_text = run_cli("--help").stdout
    for name in cli.SUBCOMMANDS:
        assert name in help_text
    # every listed subcommand has a module with register/run
    for module in cli.SUBCOMMANDS.values():
        mod = __import__(module, fromlist=["register", "run"])
        assert callable(mod.register) and callable(mod.run)


def test_unknown_subcommand_fails():
    out = run_cli("no-such-command")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_env_json_reports_stack_and_backend():
    out = run_cli("env", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["tpurec"] == tpurec.__version__
    assert info["packages"]["torch"].startswith("2.14")
    assert info["packages"]["torchrec"] == "1.9.2"
    assert info["packages"]["fbgemm-gpu-cpu"] == "1.9.0"
    assert info["packages"]["fbgemm-gpu"] is None, "CUDA fbgemm-gpu must not shadow fbgemm-gpu-cpu"
    expected = "sparsecore" if info["tpu_usable"] else "cpu-reference"
    assert info["kernel_backend"] == expected
    text = run_cli("env").stdout
    assert "kernels" in text and expected in text


@pytest.mark.parametrize("spec,kind,index", [("cpu", "cpu", None), ("meta", "meta", None), ("cpu:0", "cpu", 0)])
def test_resolve_device_strings(spec, kind, index):
    d = device.resolve_device(spec)
    assert d.type == kind and d.index == index
    assert device.resolve_device(torch.device(spec)) == d


def test_resolve_device_tpu_without_tpu_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(device, "tpu_status", lambda: device.TpuStatus(None, None, ()))
    for spec in ("tpu", "tpu:0"):
        with pytest.raises(device.TpuUnavailableError) as err:
            device.resolve_device(spec)
        msg = str(err.value)
        assert "torch_tpu is not installed" in msg and "libtpu" in msg and "device='cpu'" in msg


def test_resolve_device_tpu_n_is_this_processs_tpu_0(monkeypatch):
    # As TorchTPU on the v5e chip: one device per process, tpu:1 names tpu:0 (it reached DDP as device_ids=[1])
    monkeypatch.setattr(device, "emulated_slice", lambda: None)
    monkeypatch.setattr(device, "tpu_status", lambda: device.TpuStatus("0.2.0", "0.0.52", ("/dev/accel0",)))
    monkeypatch.setattr(device, "_load_torch_tpu", lambda: None)

    class Device:  # torch.device as torch_tpu's import leaves it (PrivateUse1 named "tpu"), for this test only
        def __init__(self, kind: str, index: int | None = None) -> None:
            self.type, self.index = kind, index

    monkeypatch.setattr(torch, "device", Device)
    for spec in ("tpu", "tpu:0", "tpu:1", "tpu:3", "privateuseone:2"):
        got = device.resolve_device(spec)
        assert (got.type, got.index) == ("tpu", 0), spec


def test_resolve_device_rejects_nonsense():
    with pytest.raises(ValueError, match="unsupported device"):
        device.resolve_device("gpu")
    with pytest.raises(TypeError):
        device.resolve_device(3)


def test_safe_env_only_when_torch_tpu_without_devices(monkeypatch):
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    monkeypatch.setattr(device, "tpu_status", lambda: device.TpuStatus("0.2.0", "0.0.50", ()))
    device.apply_safe_env()
    import os

    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0" and os.environ["TPU_SKIP_MDS_QUERY"] == "1"
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD")
    monkeypatch.setattr(device, "tpu_status", lambda: device.TpuStatus("0.2.0", "0.0.50", ("/dev/vfio/0",)))
    device.apply_safe_env()
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in os.environ
