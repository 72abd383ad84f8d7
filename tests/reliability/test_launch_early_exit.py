"""A rank that exits 0 before the process group forms (issue #43): `tpurec launch` stops the run in one
line naming it, instead of leaving the other ranks waiting in init_process_group.

Before: torch.distributed.run counted the rank done and the launch waited silently (past 200 s in the
fault campaign; init_process_group's own default is 30 minutes). The ranks here wait at most
`INIT_TIMEOUT_S`, so the old code fails this test by its timeout rather than hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.dlrm.helpers import REPO

INIT_TIMEOUT_S = 150

PROGRAM = textwrap.dedent(f"""
    import datetime, os, sys
    if os.environ["RANK"] == "1":
        sys.exit(0)  # leaves before the group forms
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={INIT_TIMEOUT_S}))
    print("formed", os.environ["RANK"], flush=True)
""")


def _launch(tmp_path, *program: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path / 'mods'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-8", *program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=INIT_TIMEOUT_S - 30,  # before the ranks give up waiting: the old code times out
        env=env,
    )


@pytest.mark.multiprocess
# 4 emulated ranks: 25 s on 2 quiet cores, 40-50 s on busy ones; the module's path in `make test-all`
@pytest.mark.parametrize("as_module", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["script", "module"])
def test_a_rank_exiting_0_before_the_group_forms_stops_the_run_in_one_line(tmp_path, as_module):
    if as_module:
        (tmp_path / "mods" / "pkg").mkdir(parents=True)
        (tmp_path / "mods" / "pkg" / "__init__.py").write_text("")
        (tmp_path / "mods" / "pkg" / "early.py").write_text(PROGRAM)
        p = _launch(tmp_path, "--", "-m", "pkg.early")
    else:
        (tmp_path / "early.py").write_text(PROGRAM)
        p = _launch(tmp_path, "early.py")
    lines = [line for line in p.stderr.splitlines() if line.startswith("tpurec")]
    assert p.returncode == 1, p.stderr
    assert len(lines) == 1, p.stderr
    says = "tpurec launch: error: rank 1 exited with code 0 before the process group formed, while "
    assert lines[0].startswith(says)
    assert lines[0].endswith("in init_process_group; stopped the run")
    assert "Traceback" not in p.stderr and "formed" not in p.stdout
