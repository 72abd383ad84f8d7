"""tpurec's entry points collect garbage less often while they import torch and TorchRec."""

import gc
import os
import subprocess
import sys

import pytest

from tpurec.runtime.gc_tuning import YOUNG_THRESHOLD, collect_less


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


@pytest.mark.parametrize(
    "before,after",
    [
        ((700, 10, 10), (YOUNG_THRESHOLD, 10, 10)),  # Python's default: raised
        ((700, 5, 20), (YOUNG_THRESHOLD, 5, 20)),  # the older generations' thresholds kept
        ((50_000, 10, 10), (50_000, 10, 10)),  # set higher already: kept
        ((0, 10, 10), (0, 10, 10)),  # collection off: stays off
    ],
)
def test_collect_less_raises_only_the_young_threshold(thresholds, before, after):
    gc.set_threshold(*before)
    collect_less()
    assert gc.get_threshold() == after


def test_the_tpurec_command_collects_less(thresholds, capsys):
    from tpurec.cli import main

    gc.set_threshold(700, 10, 10)
    assert main(["plan"]) == 2  # refused before any import: the thresholds are set first
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD


def test_importing_torchrec_after_collect_less_makes_no_full_collection():
    """What the threshold is for: with Python's defaults, importing TorchRec's planner runs 6 full
    collections, each walking every object imported so far (0.65 s of `tpurec plan`'s start,
    docs/results.md); after collect_less, none. (Without collect_less this probe prints 6.)"""
    probe = (
        "import gc, sys\n"
        "full = []\n"
        "def seen(phase, info):\n"
        "    if phase == 'stop' and info['generation'] == 2:\n"
        "        full.append(1)\n"
        "gc.callbacks.append(seen)\n"
        "from tpurec.runtime.gc_tuning import collect_less\n"
        "collect_less()\n"
        "import torchrec.distributed.planner\n"
        "print(len(full))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert int(out) == 0
