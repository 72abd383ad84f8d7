"""How a process that tpurec launches ends: without the interpreter's teardown, where gloo aborts it.

The SIGABRT at the exit of multi-rank CPU runs ("terminate called without an active exception",
docs/reliability.md) is a gloo worker thread of torch's ProcessGroupGloo (`pt_gloo_runloop`) that
drops its reference to a finished collective (`AsyncWork`) after the program's thread already
returned from the collective. When the program thread was the last other holder of a tensor of that
work which has a Python object (an `all_reduce(t)` of a Python tensor, TorchRec's all-to-all
buffers), freeing it decrefs the Python object under the GIL. If the interpreter is finalizing by
then, Python's `take_gil` ends the thread with `pthread_exit`, whose forced unwinding meets a
`noexcept` C++ destructor (`~AsyncWork`'s tensor vector) and calls `std::terminate`. A core dump of a
2-rank gloo `all_reduce` program (no TorchRec) shows exactly that stack: `runLoop` ->
`~AsyncAllreduceWork` -> `TensorImpl::decref_pyobject` -> `gil_scoped_acquire` -> `take_gil` ->
`PyThread_exit_thread` -> `pthread_exit` -> `_Unwind_ForcedUnwind` -> `std::terminate`, while the main
thread is in `Py_FinalizeEx`. `destroy_process_group()` does not help while a model (a DMP's sharding
env, its input and output dists) still holds the group: gloo's threads live on until teardown.

So a rank that finished runs its exit handlers (the interpreter still whole: a worker that needs the
GIL gets it), flushes its output and ends with `os._exit`, never finalizing the interpreter.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable, Collection
from typing import NoReturn


def exit_without_finalizing(code: int) -> NoReturn:
    """Run the exit handlers, flush stdout/stderr and logging, then `os._exit(code)`: the interpreter's
    teardown, where the abort strikes, is skipped."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The status Python gives a process that `e` ends (printing a non-integer code, as Python does)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


# Name prefixes of tpurec's own thread pools (`embedding.host_threads`): their workers are not daemon
# threads (ThreadPoolExecutor's never are) and idle on their queue once a call has its results, so
# waiting for them, as for a user's threads, would never end (a rank under `tpurec launch` hung at
# its exit, found in session 41). Python's teardown stops them; exit_without_finalizing skips it.
OWN_POOL_PREFIXES = ("tpurec-host",)


def other_threads() -> list[threading.Thread]:
    """Live non-daemon threads besides this one and tpurec's own pools' idle workers: those a
    program's ending waits for."""
    me = threading.current_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me and not t.daemon and t.is_alive() and not t.name.startswith(OWN_POOL_PREFIXES)
    ]


# True while a run_and_exit is running its main: a program it runs (an example ending itself so under
# a plain torchrun, run by `tpurec launch`'s run_script) then leaves the ending to it, whose own
# end-of-run work (the launch report) would otherwise be skipped.
_running = False


def run_and_exit(main: Callable[[], int | None], wait_for_threads: bool = False) -> NoReturn:
    """`sys.exit(main())` for a rank, ended by `exit_without_finalizing`. An exception other than
    SystemExit or KeyboardInterrupt prints its traceback (as Python does) and exits 1; a Ctrl-C keeps
    Python's own ending. `wait_for_threads`: first wait for the program's non-daemon threads, as
    `python prog.py` does (a user's program under `tpurec launch`). Called inside another
    run_and_exit's main, it is `sys.exit(main())`: the outer one ends the process."""
    global _running
    if _running:
        raise SystemExit(main())
    _running = True
    try:
        code = int(main() or 0)
    except SystemExit as e:
        code = exit_code(e)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    if wait_for_threads:
        for t in other_threads():
            t.join()
    exit_without_finalizing(code)


def end_despite_threads(command: str, code: int, before: Collection[threading.Thread] = ()) -> None:
    """After a command's result: non-daemon threads that a user's code started and left running (not
    among `before`) would keep the process alive for ever (Python waits for them before its exit).
    Warn once naming them, and end the process with `code` when the interpreter starts its shutdown,
    without waiting for them (unless they ended by then)."""
    threads = [t for t in other_threads() if t not in before]
    if not threads:
        return
    names = ", ".join(repr(t.name) for t in threads)
    print(
        f"{command}: warning: non-daemon thread{'s' if len(threads) > 1 else ''} {names} still running "
        "after the run (started by the model?); ending without waiting for "
        f"{'them' if len(threads) > 1 else 'it'}",
        file=sys.stderr,
        flush=True,
    )

    def end() -> None:
        if any(t.is_alive() for t in threads):
            exit_without_finalizing(code)

    # Python calls these first when it shuts down, before it waits for the threads.
    threading._register_atexit(end)  # type: ignore[attr-defined]
