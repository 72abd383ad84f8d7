"""The TPU result line's `hbm`: the plan's HBM figure for the rank's device beside the allocator's bytes
in use at the end (issue #59's bar: the planner within 10% of what the chip holds)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tpurec.dlrm.training.reporting import Reporting


def _reporting(planned: int | None) -> Reporting:
    model = SimpleNamespace(planned_hbm_bytes=planned)
    return Reporting(SimpleNamespace(), SimpleNamespace(), model, SimpleNamespace(), SimpleNamespace())  # type: ignore[arg-type]


def test_planned_over_in_use_when_the_device_gives_a_reading(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: 12_702_120_960)
    hbm = _reporting(8_482_709_440)._hbm_figures()
    assert hbm == {"planned_bytes": 8_482_709_440, "in_use_bytes": 12_702_120_960, "planned_over_in_use": 0.6678}


def test_no_reading_or_no_plan_gives_no_ratio(monkeypatch):
    def refuse(*a):
        raise RuntimeError("no accelerator statistics")

    monkeypatch.setattr(torch.accelerator, "memory_allocated", refuse)
    assert _reporting(2_073_440)._hbm_figures() == {
        "planned_bytes": 2_073_440,
        "in_use_bytes": None,
        "planned_over_in_use": None,
    }
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: 1_000)
    assert _reporting(None)._hbm_figures()["planned_over_in_use"] is None
