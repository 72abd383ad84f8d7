"""TorchTPU's handshake of compiled collective graphs, emulated (tpurec/emulation/handshake.py).

Two real ranks over gloo compile graphs holding an all-reduce with the emulated "tpu" backend
(tpurec/emulation/compiled.py) under each `TORCH_TPU_SPMD_HANDSHAKE_STAGE`, and report which programs
each graph became and what the handshakes decided: the same graph on both ranks stays one program with
its collective inside; a graph that differs by one constant on one rank is split at its collective on
both; DISPATCH_STAGE handshakes at every run until the first mismatch, then runs split; a rank that
never submits leaves the other's handshake to time out, naming the missing rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sharding.multiprocess import run_ranks


def _graph(scale: float) -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    def step(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * scale, "sum", list(range(dist.get_world_size()))) + 1

    return step


def _case(stage: str, scale: float, runs: int) -> dict[str, Any]:
    """Compile `_graph(scale)` fresh under `stage` and run it `runs` times: its programs at the end (the
    last compiled), the verdicts of this case's handshakes and the results."""
    import os

    import torch

    from tpurec.emulation import compiled, handshake

    os.environ[handshake.STAGE_ENV] = stage
    torch._dynamo.reset()
    before = dict(handshake.VERDICTS)
    fn = torch.compile(_graph(scale), backend=compiled.tpu_backend, fullgraph=True)
    out = [fn(torch.arange(4.0)) for _ in range(runs)]
    return {
        "kinds": [kind for kind, _, _ in compiled.COMPILED[-1]],
        "agreed": handshake.VERDICTS["agreed"] - before.get("agreed", 0),
        "split": handshake.VERDICTS["split"] - before.get("split", 0),
        "out": out[-1].tolist(),
    }


def _rank(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    from tpurec.emulation import handshake
    from tpurec.emulation.rule_error import TorchTpuRuleError

    seen: dict[str, Any] = {
        "off": _case("OFF", 2.0, 2),
        "compile_same": _case("COMPILE_STAGE", 2.0, 2),
        "compile_differs": _case("COMPILE_STAGE", 2.0 if rank == 0 else 3.0, 2),
        "dispatch_same": _case("DISPATCH_STAGE", 2.0, 3),
        "dispatch_differs": _case("DISPATCH_STAGE", 2.0 if rank == 0 else 3.0, 3),
        "figures": handshake.figures(),
    }
    os.environ[handshake.STAGE_ENV] = "COMPILE_STAGE"
    os.environ[handshake.TIMEOUT_ENV] = "1"
    if rank == 0:  # rank 1 compiles no such graph: rank 0's handshake waits 1 s, then names it
        try:
            handshake.submit("a-graph", 1)
            seen["timeout"] = None
        except TorchTpuRuleError as e:
            seen["timeout"] = str(e)
    dist.barrier()
    return seen


@pytest.mark.multiprocess
def test_the_ranks_handshake_decides_whether_a_collective_graph_stays_one_program():
    ranks = run_ranks(_rank, 2, timeout=240)
    split = ["compiled", "collective", "compiled"]  # x * scale | all_reduce | + 1
    for rank, seen in enumerate(ranks):
        # unset/OFF (TorchTPU's default): no handshake, always split at the collective
        assert seen["off"] == {"kinds": split, "agreed": 0, "split": 0, "out": [1.0, 5.0, 9.0, 13.0]}, rank
        # COMPILE_STAGE: one handshake when the graph compiles; equal graphs stay whole
        assert seen["compile_same"]["kinds"] == ["compiled"] and seen["compile_same"]["agreed"] == 1, rank
        assert seen["compile_same"]["split"] == 0, rank
        # a graph differing in one constant on one rank: both ranks split it
        assert seen["compile_differs"]["kinds"] == split, rank
        assert (seen["compile_differs"]["agreed"], seen["compile_differs"]["split"]) == (0, 1), rank
        assert seen["compile_differs"]["out"] == [1.0, 6.0, 11.0, 16.0], rank  # 2x + 3x, plus 1
        # DISPATCH_STAGE: whole, and handshaken at every run while the ranks agree
        assert seen["dispatch_same"]["kinds"] == ["compiled"], rank
        assert (seen["dispatch_same"]["agreed"], seen["dispatch_same"]["split"]) == (3, 0), rank
        # the first run's mismatch recompiles it split and ends its handshakes (1 of 3 runs)
        assert seen["dispatch_differs"]["kinds"] == split, rank
        assert (seen["dispatch_differs"]["agreed"], seen["dispatch_differs"]["split"]) == (0, 1), rank
        assert seen["figures"] == {"handshake_stage": "DISPATCH_STAGE", "handshakes_agreed": 4, "handshakes_split": 2}
    timeout = ranks[0]["timeout"]
    assert timeout is not None and "waited 1 s for rank(s) [1]" in timeout, timeout


def test_an_invalid_handshake_stage_is_refused_and_unset_is_off(monkeypatch):
    from tpurec.emulation import handshake
    from tpurec.emulation.rule_error import TorchTpuRuleError

    monkeypatch.delenv(handshake.STAGE_ENV, raising=False)
    assert handshake.stage() == "OFF" and handshake.figures() == {}
    for bad in ("", "compile_stage", "ON"):
        monkeypatch.setenv(handshake.STAGE_ENV, bad)
        with pytest.raises(TorchTpuRuleError, match="Invalid value for TORCH_TPU_SPMD_HANDSHAKE_STAGE"):
            handshake.stage()
    monkeypatch.setenv(handshake.STAGE_ENV, "COMPILE_STAGE")
    monkeypatch.setenv(handshake.TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="must be non-negative, got -1"):
        handshake.timeout_s()


def test_a_handshake_compares_the_running_collective_count_with_the_graph(monkeypatch):
    """Rank 0 of 2, the other rank's submission already in the store: the same graph fingerprint with
    another running count of compiled collectives (TorchTPU's `_RANK_COLLECTIVE_COUNTS`) is a mismatch."""
    import itertools
    from collections import Counter

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tpurec.emulation import handshake

    store = dist.HashStore()
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(handshake, "_COLLECTIVES", Counter())
    monkeypatch.setattr(handshake, "_ROUND", itertools.count())
    monkeypatch.setattr(handshake, "VERDICTS", Counter())
    monkeypatch.setenv(handshake.TIMEOUT_ENV, "1")
    store.set("tpurec/handshake/0/1", "g1/2")  # rank 1: graph g1, 2 collectives so far
    assert handshake.submit("g1", 2) is True  # rank 0: the same graph and count
    store.set("tpurec/handshake/1/1", "g2/5")  # rank 1 has compiled 3 collectives more: 5
    assert handshake.submit("g2", 1) is False  # rank 0: the same graph, 3 collectives so far
    assert store.get("tpurec/handshake/1/0") == b"g2/3"
    assert handshake.VERDICTS == Counter({"agreed": 1, "split": 1})
