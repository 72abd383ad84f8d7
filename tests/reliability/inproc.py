"""In-process `tpurec` runs for the reliability tests (no subprocess per case): the exit code,
stdout and stderr a user would see, each run time-bounded, and a tiny `tpurec train` setup."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tpurec.cli import main

BOUND_S = 60  # generous: the first case imports torch and torchrec in this process
# A `tpurec train` of a few steps on 3,000 cached synthetic rows (batch 512: 5 steps per epoch).
TINY_TRAIN = ["train", "--quiet", "--synth-rows", 3000, "--eval-every", 0, "--curves-out", "none", "--keep", 0]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """`tpurec ARGV` in this process: (exit code, stdout, stderr)."""
    import torch

    threads = torch.get_num_threads()  # a Trainer pins this process to one thread
    t0 = time.monotonic()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse refusals
        code = e.code if isinstance(e.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    assert time.monotonic() - t0 < BOUND_S, argv
    return code, out.out, out.err


def assert_refused(code, err, says, exit_code: int = 2, prefix: str = "tpurec") -> None:
    """Exit `exit_code`, `says` in stderr, exactly one line starting with `prefix` and no traceback
    (`tpurec train: error` once training has started: its plan summary is a `tpurec plan:` line)."""
    assert code == exit_code, err
    assert says in err, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith(prefix)]) == 1, err


def train_checkpoints(root: Path, cache: Path, steps: int = 4, every: int = 2) -> Path:
    """Checkpoints of a tiny run at every `every` steps up to `steps` under `root`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPUREC_CACHE", str(cache))
        argv = [*TINY_TRAIN, "--steps", steps, "--checkpoint-every", every, "--checkpoint-dir", root]
        assert main([str(a) for a in argv]) == 0
    return root


def copy_checkpoints(trained: Path, to: Path) -> Path:
    shutil.copytree(trained, to, ignore=shutil.ignore_patterns(".lock"))
    return to
