"""Real processes released together: each runs a Python script that waits for a start file, so
two of them contend for the same thing within a few milliseconds of each other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a racer script starts with: sys.argv[1] is the start file, sys.argv[2] its ready file; then
# its own arguments. Imports before WAIT, so start-up time does not decide who is first.
WAIT = """
import pathlib, sys, time
pathlib.Path(sys.argv[2]).touch()
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.002)
"""


def race(script: str, args: list[str], tmp_path: Path, n: int = 2, env: dict | None = None) -> list[subprocess.Popen]:
    """Start `n` processes of `script` (which runs WAIT after its imports) with `args` after the
    start and ready files; release them together once all are ready. Their stdout/stderr are pipes."""
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(go), str(tmp_path / f"ready{i}"), *map(str, args)],
            env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(n)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a racer did not start"
        time.sleep(0.01)
    go.touch()
    return procs
