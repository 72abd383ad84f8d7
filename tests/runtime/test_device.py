"""tpurec.runtime.device: what it reads from the host (PCI ids) and the TorchTPU environment it sets."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tpurec.runtime import device


def _pci(tmp_path, *devices):
    for i, (vendor, dev) in enumerate(devices):
        d = tmp_path / f"0000:00:{i:02x}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(dev + "\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "pci_id,generation,sparsecores",
    [
        ("0x0062", "v5p", 4),
        ("0x006f", "v6e", 2),
        ("0x0076", "v7x", 2),
        ("0x0063", "v5e", 0),
        ("0x005e", "v4", 0),
    ],
)
def test_generation_and_sparsecores_from_pci_ids(tmp_path, pci_id, generation, sparsecores):
    # A non-Google device first (an Intel NIC with the same device id) must not be mistaken for a TPU.
    root = _pci(tmp_path, ("0x8086", pci_id), ("0x1ae0", pci_id))
    assert device.tpu_generation(root) == generation
    assert device.sparsecores_per_device(device.tpu_generation(root)) == sparsecores


def test_no_tpu_means_no_generation(tmp_path):
    assert device.tpu_generation(_pci(tmp_path, ("0x8086", "0x1234"))) is None
    assert device.tpu_generation(str(tmp_path / "missing")) is None
    assert device.sparsecores_per_device("unknown-chip") is None


def _status(torch_tpu, nodes):
    return device.TpuStatus(torch_tpu=torch_tpu, libtpu="0.0.50" if torch_tpu else None, device_nodes=nodes)


@pytest.mark.parametrize(
    "torch_tpu,nodes,expected",
    [
        # TPU host: TorchRec's torch.tpu calls need the legacy APIs allowed; autoload stays on.
        ("0.2.0", ("/dev/vfio/0",), {"TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS": "1"}),
        # torch_tpu installed, no TPU: also no autoload and no metadata query.
        (
            "0.2.0",
            (),
            {
                "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS": "1",
                "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
                "TPU_SKIP_MDS_QUERY": "1",
            },
        ),
        (None, (), {}),
    ],
)
def test_safe_env(monkeypatch, torch_tpu, nodes, expected):
    names = ("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(device, "tpu_status", lambda: _status(torch_tpu, nodes))
    device.apply_safe_env()
    import os

    assert {n: os.environ[n] for n in names if n in os.environ} == expected


def test_safe_env_never_overrides_the_user(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "0")
    monkeypatch.setattr(device, "tpu_status", lambda: _status("0.2.0", ("/dev/vfio/0",)))
    device.apply_safe_env()
    import os

    assert os.environ["TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS"] == "0"


def _torch_tpu_loaded(monkeypatch, strict: bool):
    """torch_tpu as it looks after loading: its frozen flag, and strict device APIs on torch.tpu."""
    import types

    import torch

    internal: Any = types.ModuleType("torch_tpu._internal.device._device_module")
    internal._STRICT_INTERNAL_DEVICE_APIS = strict
    monkeypatch.setitem(sys.modules, "torch_tpu", types.ModuleType("torch_tpu"))
    monkeypatch.setitem(sys.modules, internal.__name__, internal)
    tpu: Any = types.ModuleType("torch.tpu")

    def is_available():
        if strict:
            raise RuntimeError("is_available is internal to TorchTPU and can only be called by the PyTorch framework")
        return True

    tpu.is_available = is_available
    monkeypatch.setattr(torch, "tpu", tpu, raising=False)
    return tpu


def test_env_problem_read_from_torch_tpus_frozen_flag_not_from_the_environment(monkeypatch):
    # torch came first: torch_tpu froze the flag as strict; tpurec then wrote the variable (too late).
    _torch_tpu_loaded(monkeypatch, strict=True)
    monkeypatch.setenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "1")
    (problem,) = device.tpu_env_problems()
    assert "torch was imported before tpurec" in problem and "correct_legacy_device_apis" in problem


def test_env_no_problem_when_torch_tpu_loaded_with_the_flag(monkeypatch):
    _torch_tpu_loaded(monkeypatch, strict=False)
    monkeypatch.delenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", raising=False)
    assert device.tpu_env_problems() == []


def test_strict_device_apis_are_corrected_to_torch_accelerator(monkeypatch):
    import torch

    device.name_tpu_backend()  # PrivateUse1 named "tpu": torch.accelerator now asks torch.tpu
    tpu = _torch_tpu_loaded(monkeypatch, strict=True)
    with pytest.raises(RuntimeError, match="internal to TorchTPU"):
        torch.tpu.is_available()
    assert device.correct_legacy_device_apis() is True
    # TorchRec's own check (torchrec/distributed/dist_data.py) now runs, answered by the accelerator's
    # C++ hooks (not torch.accelerator.is_available, which asks torch.tpu again: it recursed).
    assert torch.tpu.is_available() is False and torch.tpu.device_count() == 0
    assert torch.accelerator.is_available() is False
    assert tpu.current_stream is torch.accelerator.current_stream
    assert device.tpu_env_problems() == []
    assert device.correct_legacy_device_apis() is False  # once


@pytest.mark.parametrize(
    "usable,emulated,expected",
    [(True, None, "tpu"), (False, "v5p-8", "tpu"), (False, None, "cpu")],
)
def test_auto_is_a_tpu_when_this_process_has_one(monkeypatch, usable, emulated, expected):
    """The "auto" device, resolved in one place (tpurec train, selftest, DMP's device=None): a usable TPU
    or an emulated TPU rank's, else the CPU; a kind asked for by name is that kind."""
    nodes = ("/dev/vfio/0",) if usable else ()
    monkeypatch.setattr(device, "tpu_status", lambda: _status("0.2.0" if usable else None, nodes))
    if emulated:
        monkeypatch.setenv(device.EMULATE_ENV, emulated)
    else:
        monkeypatch.delenv(device.EMULATE_ENV, raising=False)
    assert device.resolve_choice("auto") is device.DeviceKind(expected)
    assert device.resolve_choice("cpu") is device.DeviceKind.CPU
    assert device.resolve_choice(device.DeviceKind.TPU) is device.DeviceKind.TPU
