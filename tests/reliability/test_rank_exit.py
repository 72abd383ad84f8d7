"""A `tpurec train` rank that finished exits without the interpreter's teardown (where the rare SIGABRT
at exit of multi-rank CPU runs struck: docs/reliability.md), but after its exit handlers and with its
output flushed."""

import subprocess
import sys

from tests.dlrm.helpers import REPO

PROGRAM = """
import atexit, sys
from tpurec.dlrm.__main__ import exit_without_finalizing

class Torn:
    def __del__(self):
        print("torn down", flush=True)

keep = Torn()  # freed only by the interpreter's teardown
atexit.register(lambda: print("exit handler ran", end=""))
print("last line", end="")
sys.stderr.write("unflushed error")
exit_without_finalizing(3)
"""


def test_exit_runs_the_handlers_flushes_and_skips_the_teardown():
    p = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "last lineexit handler ran"  # flushed, handlers run, no teardown's "torn down"
    assert p.stderr.endswith("unflushed error")


def test_without_it_the_teardown_runs():  # the probe above can tell teardown apart
    program = PROGRAM.replace("exit_without_finalizing(3)", "sys.exit(3)")
    p = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 3 and "torn down" in p.stdout
