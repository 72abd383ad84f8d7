"""`python -P -m tpurec.runtime.run_script SCRIPT ARGS`: SCRIPT run as `python SCRIPT ARGS` runs it.

`tpurec launch prog.py` starts every rank this way (`tpurec.runtime.safe_path`): the rank's Python
starts with the working directory off sys.path, and here the script's own directory goes first, as
Python puts it for `python prog.py`, so the program imports its sibling modules as it would there.
`sys.argv`, `__file__` and `__name__ == "__main__"` are as under `python prog.py`; the program's
environment is the caller's (PYTHONSAFEPATH as the caller had it). `tpurec` is imported before the
program (this module is part of it): in an emulated rank that installs TorchTPU's stand-ins before the
program's first line, as the program's own `import tpurec` would.
"""

from __future__ import annotations

import os
import runpy
import sys

from tpurec.runtime import safe_path


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -P -m tpurec.runtime.run_script SCRIPT [ARGS...]")
    script = argv[0]
    if not safe_path.restore_caller_env():
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    sys.argv = list(argv)
    runpy.run_path(os.path.abspath(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
