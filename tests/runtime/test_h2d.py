"""tpurec/runtime/h2d.py: the host->device route of the inputs and the host tier's rows. The JAX route
is checked on JAX's CPU device (where DLPack hands torch a CPU tensor): the same bits arrive, bfloat16
included; a refusal falls back to torch's copy, said once; off a TorchTPU device nothing changes."""

from __future__ import annotations

import pytest
import torch

from tpurec.runtime import h2d


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(h2d, "_REFUSED", [])


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.float32, torch.bfloat16])
def test_the_jax_route_delivers_the_same_bits(dtype):
    t = (torch.arange(-500, 500) * 37).to(dtype)
    out = h2d.via_jax(t, torch.device("cpu"))
    assert out.dtype == dtype and out.shape == t.shape and out.device.type == "cpu"
    assert torch.equal(
        out.view(torch.int16) if dtype == torch.bfloat16 else out, t.view(torch.int16) if dtype == torch.bfloat16 else t
    )
    assert not h2d._REFUSED


def test_a_refused_route_falls_back_to_torch_once(monkeypatch):
    def refuse(*a, **k):
        raise BufferError("no DLPack here")

    monkeypatch.setattr(torch, "from_dlpack", refuse)
    t = torch.arange(10, dtype=torch.int32)
    with pytest.warns(UserWarning, match="TPUREC_H2D=jax: BufferError: no DLPack here"):
        out = h2d.via_jax(t, torch.device("cpu"))
    assert torch.equal(out, t) and h2d._REFUSED == ["BufferError: no DLPack here"]


def test_the_route_applies_to_torchtpu_devices_only(monkeypatch):
    calls = []
    monkeypatch.setattr(h2d, "via_jax", lambda t, d: calls.append(d) or t)
    monkeypatch.setenv(h2d.ROUTE_ENV, "jax")
    assert h2d.route() == "jax"
    t = torch.ones(3)
    assert torch.equal(h2d.to_device(t, torch.device("cpu")), t) and calls == []  # a CPU: torch's copy
    monkeypatch.setattr(h2d, "on_torchtpu", lambda d: True)
    h2d.to_device(t, torch.device("meta"))
    assert calls == [torch.device("meta")]
    monkeypatch.setenv(h2d.ROUTE_ENV, "torch")
    assert h2d.route() == "torch" and h2d.to_device(t, torch.device("meta")).device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_started_host_copy_gives_the_same_bits(monkeypatch, dtype):
    monkeypatch.setenv(h2d.ROUTE_ENV, "jax")
    monkeypatch.setattr(h2d, "on_torchtpu", lambda d: True)  # JAX's CPU device stands for the chip
    t = (torch.arange(-300, 300) * 0.37).to(dtype)
    copy = h2d.start_to_host(t)
    assert copy.array is not None and not h2d._REFUSED  # started through JAX
    out = copy.result()
    bits = (lambda x: x.view(torch.int16)) if dtype == torch.bfloat16 else (lambda x: x)
    assert out.dtype == dtype and torch.equal(bits(out), bits(t)) and out.data_ptr() != t.data_ptr()


def test_a_host_copy_off_the_route_is_torchs_at_result(monkeypatch):
    t = torch.arange(6.0)
    copy = h2d.start_to_host(t)  # no TPUREC_H2D: nothing started
    assert copy.array is None and torch.equal(copy.result(), t)
