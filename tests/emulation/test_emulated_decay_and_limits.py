"""Weight decay and batches over their id limits on an emulated v5p-8 slice: no program compiled after
warm-up, one device->host copy per step (the loss), and CPU gloo's logloss on the same plan and seed
(issue #36 item 7; docs/tpu.md, "Weight decay"; docs/id_limits.md, section 4)."""

from __future__ import annotations

import json
import os

import pytest

from tests.dlrm.helpers import train
from tpurec.cli import main

ROWS = 20_000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """`tpurec train`'s own synthetic data (seed 3) in a cache of its own, the planner's v5p-8 plan for
    dlrm-tiny, and limits an eighth of what `tpurec data stats` measured on that data: every batch
    runs over them, in several passes."""
    from tpurec.dlrm import data

    root = tmp_path_factory.mktemp("decay_limits")
    old = os.environ.get("TPUREC_CACHE")
    os.environ["TPUREC_CACHE"] = str(root)
    try:
        synth = data.ensure_synth("dlrm-tiny", ROWS, 3, say=lambda _: None)
    finally:
        if old is None:
            del os.environ["TPUREC_CACHE"]
        else:
            os.environ["TPUREC_CACHE"] = old
    plan, limits = root / "P.json", root / "limits.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--format", "json", "--out", str(plan)]) == 0
    assert main(["data", "stats", str(synth), "--model", "dlrm-tiny", "--plan", str(plan), "--out", str(limits)]) == 0
    measured = json.loads(limits.read_text())
    for t in measured["tables"].values():
        for k in (
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
            "max_ids_per_slice",
            "max_unique_ids_per_slice",
        ):
            t[k] = max(8, -(-t[k] // 8) // 8 * 8)
    small = root / "small.json"
    small.write_text(json.dumps(measured))
    return root, plan, small


def _both(setup, steps: int, *extra) -> tuple[dict, dict]:
    root, plan, _ = setup
    args = ("--synth-rows", ROWS, "--plan", plan, "--steps", steps, "--eval-every", 10, "--seed", 3, *extra)
    emulated, _ = train("--emulate-tpu", "v5p-8", *args, cache=root, timeout=1200)
    cpu, _ = train("--nproc", 4, *args, cache=root, timeout=1200)
    assert emulated is not None and cpu is not None
    return emulated, cpu


def _check(emulated: dict, cpu: dict) -> None:
    assert emulated["world_size"] == cpu["world_size"] == 4
    assert emulated["recompiles_after_warmup"] == 0, emulated["recompiled_ops"]
    assert emulated["device_to_host_copies_per_step"] <= 1.0, emulated["device_to_host_copies"]
    assert abs(emulated["logloss"] - cpu["logloss"]) <= 1e-5, (emulated["logloss"], cpu["logloss"])


@pytest.mark.slow  # two 4-rank runs: over 35 s
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
def test_rowwise_adagrad_weight_decay_compiles_nothing_after_warmup_and_equals_cpu_gloo(setup, mode, monkeypatch):
    # The CPU ranks on the SparseCore layout path, the arithmetic the emulated TPU runs.
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    emulated, cpu = _both(setup, 30, "--embedding-weight-decay", 0.01, "--embedding-weight-decay-mode", mode)
    _check(emulated, cpu)
    assert emulated["id_limits"]["multipass_batches"] == 0  # within the limits: the decay's own shapes


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", [None, "L2", "DECOUPLE"])
def test_batches_over_their_limits_compile_nothing_after_warmup_and_equal_cpu_gloo(setup, mode, monkeypatch):
    """Before, each update pass's gradient was sliced out of one [passes x batch] tensor gathered
    over a power of two of entries: 5 programs after warm-up in this 40-step run (aten::slice at a
    new pass's offset, new_zeros, index_add_)."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    decay = ("--embedding-weight-decay", 0.01, "--embedding-weight-decay-mode", mode) if mode else ()
    emulated, cpu = _both(setup, 40, "--limits", setup[2], *decay)
    assert emulated["id_limits"]["multipass_batches"] > 40  # every batch over its limits
    _check(emulated, cpu)
