"""`python -P -m tpurec.runtime.run_script SCRIPT ARGS`: SCRIPT run as `python SCRIPT ARGS` runs it.

`tpurec launch prog.py` starts every rank this way (`tpurec.runtime.safe_path`): the rank's Python
starts with the working directory off sys.path, and here the script's own directory goes first, as
Python puts it for `python prog.py`, so the program imports its sibling modules as it would there.
`sys.argv`, `__file__` and `__name__ == "__main__"` are as under `python prog.py`; the program's
environment is the caller's (PYTHONSAFEPATH as the caller had it). `tpurec` is imported before the
program (this module is part of it): in an emulated rank that installs TorchTPU's stand-ins before the
program's first line, as the program's own `import tpurec` would.

A `tpurec.errors.UserError` the program lets through (tpurec refusing its input: `id_limits`, a plan)
is one line, printed once for every rank that raised it (`tpurec.runtime.rank_errors`), exit 2; under
a launcher a Ctrl-C ends the rank with 130 without a traceback (the launcher says it in one line).

`-m MODULE ARGS` runs a module as `python -P -m MODULE ARGS` would. Either way the rank records
whether its process group formed before the program ended (`tpurec.runtime.group_watch`), so the
launcher notices a rank that leaves while the others wait for it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from tpurec.errors import EXIT_USER_ERROR, UserError
from tpurec.runtime import group_watch, rank_errors, rank_exit, run_report, safe_path


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -P -m tpurec.runtime.run_script SCRIPT [ARGS...]")
    if argv[0] == "-m" and len(argv) < 2:
        sys.exit("usage: python -P -m tpurec.runtime.run_script -m MODULE [ARGS...]")
    module = argv[1] if argv[0] == "-m" else None
    # a module keeps the ranks' PYTHONSAFEPATH, as it had when torch.distributed.run started it directly
    caller_safe = module is None and safe_path.restore_caller_env()
    group_watch.watch_group_forming()
    code = 1  # an exception: Python exits 1 after printing it
    try:
        if module is not None:
            sys.argv = [module, *argv[2:]]  # run_module sets argv[0] to the module's file
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            if not caller_safe:
                sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
            sys.argv = list(argv)
            runpy.run_path(os.path.abspath(script), run_name="__main__")
        code = 0
        run_report.write()  # the launcher's end-of-run checks (tpurec/runtime/run_report.py)
    except SystemExit as e:
        code = group_watch.exit_code(e)
        if code == 0:  # sys.exit(0) ends a program as well as its last line
            run_report.write()
        raise
    except UserError as e:  # tpurec's one-line error, from tpurec code the program called: printed once
        code = EXIT_USER_ERROR
        rank_errors.report("tpurec launch: error", str(e))
        raise SystemExit(code) from None
    except KeyboardInterrupt:
        if not os.environ.get(group_watch.WATCH_ENV):
            raise
        code = 128 + signal.SIGINT  # stopped with the run: the launcher says so in one line, not each rank
        raise SystemExit(code) from None
    finally:
        group_watch.program_ended(code)


if __name__ == "__main__":
    # Ended as `python prog.py` ends (its non-daemon threads waited for, its exit handlers run), but
    # without the interpreter's teardown, where gloo can abort a finished rank (rank_exit.py).
    rank_exit.run_and_exit(lambda: main(sys.argv[1:]), wait_for_threads=True)
