"""The --nproc launcher's one line for torch.distributed.run's failures (real ProcessFailure objects)."""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tpurec.launch.agent import summary


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = timestamp
    return f


def test_the_rank_that_failed_on_its_own_leads_and_sets_the_exit_code():
    # same second: the launcher's SIGTERM of rank 0 came after rank 1's SIGKILL
    line, code = summary({0: _failure(0, -signal.SIGTERM, 7), 1: _failure(1, -signal.SIGKILL, 7)})
    assert line == (
        "tpurec train: rank 1 was killed by SIGKILL, rank 0 was killed by SIGTERM; "
        "torch.distributed.run stopped the other ranks"
    )
    assert code == 128 + signal.SIGKILL


def test_bad_input_on_any_rank_exits_2_and_earlier_failures_come_first():
    line, code = summary({0: _failure(0, 3, 9), 1: _failure(1, 2, 8)})
    assert line.startswith("tpurec train: rank 1 exited with code 2, rank 0 exited with code 3;")
    assert code == 2
