"""What a SIGKILLed writer leaves, the next writer removes and names (issue #29, item 4 leftovers).

SIGKILL (an OOM kill, a power cut) gives a process no chance to clean up: `data synth` / `data
convert` leave `part-N.parquet.tmp-PID` in `--out`, `tpurec train` a `.ENTRY.tmp-*` directory in the
synthetic-data cache. Each case kills a real process with SIGKILL while it writes, checks the
temporary files are there, then runs the next writer: it removes them and says so in one line.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.inproc import run_cli

REPO = Path(__file__).resolve().parents[2]


def _stderr(p: subprocess.Popen) -> str:
    return p.stderr.read().decode()[-2000:] if p.stderr is not None else ""


def _matching(pattern: Path) -> list[Path]:
    return sorted(Path(f) for f in glob.glob(str(pattern)))


def _killed_while_writing(cmd: list[str], pattern: Path, env: dict | None = None) -> list[Path]:
    """Start `cmd`, SIGKILL it once a file matching `pattern` (wildcards anywhere) holds data, and
    return the temporary files it left."""
    p = subprocess.Popen(
        [sys.executable, *cmd],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not [f for f in _matching(pattern) if f.stat().st_size > 0]:
            assert p.poll() is None, f"finished before it could be killed: {_stderr(p)}"
            assert time.monotonic() < deadline, "never wrote a temporary file"
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
        if p.stderr is not None:
            p.stderr.close()
    left = _matching(pattern)
    assert left, "SIGKILL left nothing behind: nothing to test"
    return left


SYNTH_FOREVER = ["-m", "tpurec.cli", "data", "synth", "--rows", "5000000", "--row-group-size", "2000", "--quiet"]


@pytest.mark.parametrize("then", ["synth", "convert"])
def test_the_next_synth_or_convert_into_the_same_out_removes_what_a_killed_run_left(tmp_path, capsys, tsv, then):
    out = tmp_path / "out"
    left = _killed_while_writing([*SYNTH_FOREVER, "--out", str(out)], out / "part-*.parquet.tmp-*")
    if then == "synth":
        code, _, err = run_cli(["data", "synth", "--rows", 3000, "--out", out, "--quiet"], capsys)
    else:
        code, _, err = run_cli(["data", "convert", tsv, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if "killed run" in line]
    assert said == [
        f"tpurec data: removed {len(left)} temporary file(s) that a killed run left in {out} ({left[0].name})"
    ]
    assert not any(f.exists() for f in left)
    assert sorted(f.name for f in out.iterdir() if ".tmp-" in f.name) == []
    assert (out / "_dataset.json").is_file()


def test_the_next_run_making_synthetic_data_removes_a_killed_runs_temporary_directory(tmp_path, monkeypatch):
    from tpurec.data import leftovers
    from tpurec.dlrm.data import ensure_synth

    cache = tmp_path / "cache"
    make = "from tpurec.dlrm.data import ensure_synth; ensure_synth('dlrm-tiny', 5_000_000, 7)"
    env = {"TPUREC_CACHE": str(cache)}
    monkeypatch.setenv("TPUREC_CACHE", str(cache))
    parts = _killed_while_writing(["-c", make], cache / ".*.tmp-*" / "part-*.parquet.tmp-*", env)
    stale = parts[0].parent
    # a live writer's directory (its lock held) beside it is left alone, however old
    live = stale.parent / ".synth-live.tmp-x"
    live.mkdir()
    held = leftovers.lock_dir(live, RuntimeError)
    os.utime(live, (0, 0))
    said = []
    try:
        ensure_synth("dlrm-tiny", 3000, 7, say=said.append)
        assert live.is_dir()
    finally:
        held.close()
    assert not stale.exists()
    assert [m for m in said if "killed run" in m] == [
        f"data: removed 1 temporary director(ies) that a killed run left: {stale}"
    ]
