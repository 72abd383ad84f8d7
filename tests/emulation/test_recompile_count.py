"""The emulation's count of programs first asked for after warm-up (`recompiles_after_warmup`), on
the device's record alone: every other test asserts it is 0 on a real run, which a count that
missed a kind of phase (evaluation passes) would pass too."""

from __future__ import annotations

import pytest

from tpurec.emulation import device
from tpurec.emulation.rank import EmulatedRank
from tpurec.planner.topology import parse_slice


@pytest.fixture
def rank():
    saved = device.RECORD
    device.RECORD = device.DeviceRecord()  # this test's own record; the process's is put back after
    try:
        yield EmulatedRank(parse_slice("v5p-8"), 0, ops=None)  # ops: unused by the counter
    finally:
        device.RECORD = saved


def test_programs_first_asked_after_warmup_are_counted_in_training_and_evaluation(rank):
    device.RECORD.program("tensorcore", "aten::mm", (1,))  # setup: always warm-up
    for _ in range(2):  # training's warm-up: the first two steps
        rank.begin("train")
        device.RECORD.program("tensorcore", "aten::mm", (2,))
        device.RECORD.program("compiled", "graph:a", ("forward", 0, ()))  # a torch.compile graph (compiled.py)
    rank.begin("train")  # step 3: a new program is a recompile; one already compiled is not
    device.RECORD.program("tensorcore", "aten::mm", (1,))
    device.RECORD.program("sparsecore", "tpurec::sparse_dense_matmul", (3,))
    rank.begin("eval")  # evaluation's warm-up: its first pass
    device.RECORD.program("tensorcore", "aten::mm", (4,))
    rank.begin("eval")  # the second pass: two new programs, asked twice each
    for _ in range(2):
        device.RECORD.program("tensorcore", "aten::mm", (5,))
        device.RECORD.program("collective", "c10d::allreduce_", (6,))
    rank.begin("train")  # step 4, after an evaluation: a program only evaluation asked for before is no recompile
    device.RECORD.program("tensorcore", "aten::mm", (5,))
    device.RECORD.program("compiled", "graph:a", ("forward", 0, ()))  # the same graph: no recompile
    device.RECORD.program("compiled", "graph:a", ("forward", 0, ((8,),)))  # new input shapes: a recompile
    assert rank.recompiles_after_warmup() == 4
    assert sorted(rank.late_programs()) == [
        ("collective", "c10d::allreduce_", (6,)),
        ("compiled", "graph:a", ("forward", 0, ((8,),))),
        ("sparsecore", "tpurec::sparse_dense_matmul", (3,)),
        ("tensorcore", "aten::mm", (5,)),
    ]
    assert rank.programs_compiled() == {
        "sparsecore": {"tpurec::sparse_dense_matmul": 1},
        "tensorcore": 4,
        "collective": 1,
        "compiled": 2,
    }
