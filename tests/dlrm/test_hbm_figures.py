"""The TPU result line's `hbm`: the plan's HBM figure for the rank's device beside the allocator's bytes
in use at the end and the most it held at a logged step (issue #59's bar: the planner within 10% of
what the chip holds)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tpurec.dlrm.training.progress import Progress
from tpurec.dlrm.training.reporting import Reporting
from tpurec.runtime.device import DeviceKind


def _reporting(planned: int | None, most: int | None = None) -> Reporting:
    model = SimpleNamespace(planned_hbm_bytes=planned)
    progress = SimpleNamespace(max_device_bytes=most)
    return Reporting(SimpleNamespace(), SimpleNamespace(), model, SimpleNamespace(), progress)  # type: ignore[arg-type]


def test_planned_over_in_use_when_the_device_gives_a_reading(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: 12_702_120_960)
    hbm = _reporting(8_482_709_440)._hbm_figures()
    assert hbm == {
        "planned_bytes": 8_482_709_440,
        "in_use_bytes": 12_702_120_960,
        "planned_over_in_use": 0.6678,
        "max_in_use_bytes": 12_702_120_960,  # no logged reading: the end's
        "planned_over_max_in_use": 0.6678,
    }
    # session 34's chip: 8.50 GB at the end, 12.93 GB after the warm-up's queued steps
    hbm = _reporting(11_649_357_282, most=12_929_742_848)._hbm_figures()
    assert hbm["planned_over_max_in_use"] == 0.901 and hbm["max_in_use_bytes"] == 12_929_742_848


def test_no_reading_or_no_plan_gives_no_ratio(monkeypatch):
    def refuse(*a):
        raise RuntimeError("no accelerator statistics")

    monkeypatch.setattr(torch.accelerator, "memory_allocated", refuse)
    assert _reporting(2_073_440)._hbm_figures() == {
        "planned_bytes": 2_073_440,
        "in_use_bytes": None,
        "planned_over_in_use": None,
        "max_in_use_bytes": None,
        "planned_over_max_in_use": None,
    }
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: 1_000)
    assert _reporting(None)._hbm_figures()["planned_over_in_use"] is None


def test_logged_steps_keep_the_most_bytes_on_the_tpu_path_only(monkeypatch):
    readings = iter([5, 9, 7])
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: next(readings))
    progress = Progress.__new__(Progress)
    progress.max_device_bytes = None
    progress.run = SimpleNamespace(device=DeviceKind.CPU)
    progress.sample_device_bytes()
    assert progress.max_device_bytes is None  # a CPU run reads nothing
    progress.run = SimpleNamespace(device=DeviceKind.TPU)
    for _ in range(3):
        progress.sample_device_bytes()
    assert progress.max_device_bytes == 9
