"""A rank tpurec launches exits without the interpreter's teardown, where a gloo worker thread freeing a
finished collective's tensors aborted it (SIGABRT, "terminate called without an active exception":
tpurec/runtime/rank_exit.py, docs/reliability.md), but after its exit handlers and with its output
flushed."""

import os
import signal
import subprocess
import sys

import pytest

from tests.dlrm.helpers import REPO

PROGRAM = """
import atexit, sys
from tpurec.runtime.rank_exit import exit_without_finalizing

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


# Two gloo ranks, each ending right after a collective of a Python tensor: the program that aborted
# now and then (2 runs of 10 here, a rank's core dump showing the gloo worker in `take_gil` ->
# `pthread_exit` -> `std::terminate` during `Py_FinalizeEx`).
GLOO_PROGRAM = """
import sys, torch, torch.distributed as dist
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
for _ in range(3):
    t = torch.ones(1000)
    dist.all_reduce(t)
    del t
print("rank", rank, "done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_ranks_run_by_tpurec_never_end_by_sigabrt(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(GLOO_PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    for run in range(10):
        store = tmp_path / f"store-{run}"
        ranks = [
            subprocess.Popen(
                [sys.executable, "-P", "-m", "tpurec.runtime.run_script", str(prog), str(r), str(store)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
                env=env,
            )
            for r in range(2)
        ]
        for r, p in enumerate(ranks):
            out, err = p.communicate(timeout=300)
            assert p.returncode != -signal.SIGABRT, f"run {run}: rank {r} ended by SIGABRT:\n{err[-2000:]}"
            assert p.returncode == 0, err[-2000:]
            assert out == f"rank {r} done\n"


def test_a_launched_program_is_ended_as_python_ends_it(tmp_path):
    """Its non-daemon threads waited for, its exit handlers run, its exit code and exceptions kept."""
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('handler', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n"
        "print('main', flush=True)\n"
        "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(arg):
        cmd = [sys.executable, "-P", "-m", "tpurec.runtime.run_script", str(prog), arg]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)

    p = run("5")
    assert (p.returncode, p.stdout) == (5, "main\nthread\nhandler\n"), p.stderr
    p = run("bye")  # sys.exit("bye"): printed, exit 1
    assert (p.returncode, p.stderr) == (1, "bye\n")
    prog.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    p = run("0")
    assert p.returncode == 1 and "Traceback" in p.stderr and p.stderr.endswith("ValueError: boom\n")


def test_inside_another_run_and_exit_it_leaves_the_ending_to_the_outer_one(monkeypatch):
    """An example ending itself through run_and_exit (for a plain torchrun), run by `tpurec launch`'s
    run_script: the inner call raises SystemExit with the program's code, so the outer one still writes
    the launch report and ends the process (the report line was lost when the inner one ended it)."""
    from tpurec.runtime import rank_exit

    monkeypatch.setattr(rank_exit, "_running", True)
    with pytest.raises(SystemExit) as stop:
        rank_exit.run_and_exit(lambda: 3, wait_for_threads=True)
    assert stop.value.code == 3
    with pytest.raises(ZeroDivisionError):  # an error reaches the outer one's handlers as it is
        rank_exit.run_and_exit(lambda: 1 // 0)
