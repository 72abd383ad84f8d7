"""`python -m tpurec.launch.agent ARGS`: torch.distributed.run (ARGS are its own) ending in one line.

torch.distributed.run already stops every rank when one fails, but then reports the failure as a
Python traceback of its own, with a multi-line box of details. Here it runs in-process and its
failure becomes one line naming each failed rank and how it ended (exit code or signal); its own
log lines are silenced. Exit code: 2 if a rank reported bad input, else the first failure's code
(128 + N for signal N, as a shell reports it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection
    from types import FrameType

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"was killed by {name}"
    return f"exited with code {failure.exitcode}"


def _code(failure: ProcessFailure) -> int:
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


def summary(failures: dict, command: str = "tpurec train", reported: Collection[int] = ()) -> tuple[str, int]:
    """(the one line, the exit code) for torch.distributed.run's {rank: ProcessFailure}. `reported`:
    ranks that told the launcher their error themselves (`tpurec.runtime.rank_errors`): left out of the
    line, which is empty when the others were only stopped by torch.distributed.run (SIGTERM)."""
    # Earliest first; within a second, ranks ended by SIGTERM last: that is how the launcher stops
    # the others once one has failed, so the rank that failed on its own leads the line.
    order = sorted(failures, key=lambda r: (failures[r].timestamp, failures[r].exitcode == -signal.SIGTERM, r))
    codes = [failures[r].exitcode for r in order]
    code = 2 if 2 in codes else (_code(failures[order[0]]) or 1)
    told = [r for r in order if r in reported]
    order = [r for r in order if r not in reported]
    if told and all(failures[r].exitcode == -signal.SIGTERM for r in order):
        return "", code
    parts = [f"rank {r} {_how(failures[r])}" for r in order]
    return f"{command}: {', '.join(parts)}; torch.distributed.run stopped the other ranks", code


def _stop_once() -> None:
    """torch.distributed.run raises SignalException at every SIGINT/SIGTERM, also one that arrives
    while it is stopping the ranks for the first, which cuts that shutdown short: the ranks are then
    killed before they can say what they left. A Ctrl-C reaches this agent twice (from the terminal
    and relayed by `tpurec train`), so only the first counts; the shutdown (the signal passed to the
    ranks, --shutdown-timeout, then SIGKILL) goes on."""
    from torch.distributed.elastic.multiprocessing import api

    first = api._terminate_process_handler
    stopping: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not stopping:
            stopping.append(signum)
            first(signum, frame)

    api._terminate_process_handler = handler


def main(argv: list[str] | None = None) -> int:
    from tpurec.runtime.gc_tuning import collect_less

    collect_less()  # before torch loads
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _stop_once()

    # Its INFO/WARNING/ERROR lines ("Sending process ... closing signal", the failure box) would
    # repeat what the ranks and the line below say.
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
        return 0
    except ChildFailedError as e:
        from tpurec.launch.hosts import COMMAND_ENV
        from tpurec.runtime import group_watch, rank_errors

        told = rank_errors.reported(os.environ.get(group_watch.WATCH_ENV))
        line, code = summary(e.failures, os.environ.get(COMMAND_ENV, "tpurec train"), told)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:  # SIGTERM/SIGINT/SIGHUP: the ranks were stopped with it
        return 128 + int(e.sigval)


if __name__ == "__main__":
    sys.exit(main())
