"""tpurec.device: what it reads from the host (PCI ids) and the TorchTPU environment it sets."""

from __future__ import annotations

import sys

import pytest

from tpurec import device


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


def test_env_problem_named_when_torch_tpu_loaded_without_legacy_apis(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tpu", object())
    monkeypatch.delenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", raising=False)
    (problem,) = device.tpu_env_problems()
    assert "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1" in problem and "import tpurec before torch" in problem
    monkeypatch.setenv("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "1")
    assert device.tpu_env_problems() == []
