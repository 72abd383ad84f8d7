"""Steps far slower on the host than those before them (tpurec/dlrm/training/slow_steps.py): on a TPU a
program compiled mid-run. The detector on the chip's own step times, and a run that reports one."""

from __future__ import annotations

import time

import pytest

from tpurec.dlrm.training.slow_steps import SlowSteps, message

from .helpers import train_here

# `tpurec train --device tpu` at MLPerf DLRM-DCNv2 shapes on a v5e, the seconds between steps 1-15
# (session 35, docs/results.md `tt-steps`): with the narrow inputs' layout changing (steps 4 and 10
# compiled new programs) and with every input wide (none did)
NARROW = [74.678, 13.407, 0.415, 27.996, 0.298, 1.778, 0.295, 0.304, 0.278, 7.567, 0.305, 0.316, 0.276, 0.276, 0.278]
WIDE = [23.516, 12.261, 0.421, 1.132, 0.337, 0.28, 0.405, 0.339, 0.37, 0.284, 0.28, 0.275, 0.357, 0.199, 0.281]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def _watch(seconds: list[float]) -> SlowSteps:
    """The steps' seconds as the trainer gives them: the first step of the run not timed."""
    watch = SlowSteps()
    for step, s in enumerate(seconds, start=1):
        watch.add(step, None if step == 1 else s)
    return watch


def test_the_chips_recompiling_steps_are_found_and_its_steady_run_has_none():
    found = _watch(NARROW).figures()
    assert found["count"] == 2 and found["first"] == [[4, 27.996, 0.415], [10, 7.567, 0.304]]
    assert found["median_step_s"] == 0.304  # the first two (compiling) steps left out
    assert _watch(WIDE).figures() == {"count": 0, "first": [], "median_step_s": 0.337}
    assert message((4, 27.996, 0.415)).startswith("step 4 took 28.0 s on the host against a median of 0.415 s")


def test_short_steps_a_few_times_the_median_are_not_slow_steps():
    # a CPU run's 20 ms steps with a 0.5 s hiccup (25x, under the 1 s floor) and a 1.2 s one (counted)
    watch = _watch([3.0, 1.0] + [0.02] * 10 + [0.5] + [0.02] * 5 + [1.2])
    assert watch.figures()["count"] == 1 and watch.slow == [(19, 1.2, 0.02)]
    assert watch.add(20, None) is None and len(watch.seconds) == 18  # a segment's first step: not timed


def test_a_run_with_a_slow_step_reports_it_and_says_so_once(cache, capsys, monkeypatch):
    """A DLRM run on the CPU whose 8th and 11th steps are held 1.5 s on the host (as a compile would hold
    them): `slow_steps` counts both, stderr names the first. In this process (`train_here`): the
    detector and its message need no process of their own, and a subprocess cost an import of torch
    and TorchRec."""
    from tpurec.dlrm import trainer as T

    advance = T.Trainer._advance

    def held(self):
        out = advance(self)
        if self.step_count in (8, 11):
            time.sleep(1.5)
        return out

    monkeypatch.setattr(T.Trainer, "_advance", held)
    result, _, err = train_here(capsys, "--synth-rows", 30000, "--steps", 14, "--eval-every", 0, cache=cache)
    slow = result["slow_steps"]
    assert slow["count"] == 2 and [s[0] for s in slow["first"]] == [8, 11], slow
    assert all(s[1] >= 1.5 for s in slow["first"]) and slow["median_step_s"] < 0.3
    assert err.count("took") == 1 and "step 8 took" in err, err[-2000:]
