"""Run `tpurec train` as a user would (a subprocess), and read its checkpoints back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train(*args, cache, timeout=600, check=True, pythonpath=()) -> tuple[dict | None, subprocess.CompletedProcess]:
    """`python -m tpurec.cli train ARGS` with its synthetic-data cache in `cache`; (final JSON, process).
    pythonpath: directories put before the repository on the ranks' PYTHONPATH."""
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(REPO)]))
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "train", "--quiet", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"tpurec train {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-4000:]}")
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    return (json.loads(lines[-1]) if lines and p.returncode == 0 else None), p


def train_here(capsys, *args, cache, check=True) -> tuple[dict | None, int, str]:
    """`tpurec train --quiet ARGS` in this process, its synthetic-data cache in `cache`: (final JSON, exit
    code, stderr). `train` above pays an import of torch and TorchRec (5-8 s) for each run; this is for
    tests whose runs need no process of their own (no ranks, signals, environment or exit of theirs)."""
    import pytest

    from tests.reliability.inproc import run_cli

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPUREC_CACHE", str(cache))
        code, out, err = run_cli(["train", "--quiet", *args], capsys)
    if check and code != 0:
        raise AssertionError(f"tpurec train {' '.join(map(str, args))} exited {code}:\n{err[-4000:]}")
    lines = [line for line in out.splitlines() if line.strip()]
    return (json.loads(lines[-1]) if lines and code == 0 else None), code, err


def train_losses(path) -> list[float]:
    """The training losses of a `--metrics-out` file, in step order."""
    return [r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if r["kind"] == "train"]


def checkpoint_tensors(path) -> dict:
    """Every tensor of a DCP checkpoint, unsharded, by flattened key (via a torch.save conversion)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(path).parent / (Path(path).name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    sd = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v

    walk("", sd)
    return flat


def checkpoint_meta(step: int, **config) -> dict:
    """A meta.json as the trainer writes it (every field ckpt_meta.META_FIELDS requires)."""
    return {
        "step": step,
        "samples": 64 * step,
        "world_size": 1,
        "batch_size": 64,
        "epoch": 0,
        "epoch_fraction": 0.5,
        "config": config,
        "data": "synthetic",
    }


def train_state(step: int) -> dict:
    """A rank-R.json as the trainer writes it (reader position, RNG states, step)."""
    from tpurec.dlrm.ckpt import checkpoint as ckpt

    reader = {"epoch": 0, "rows_consumed": 64 * step, "num_rows": 1000, "rank": 0, "world_size": 1}
    return {"reader": reader | {"seed": 0, "shuffle": True}, "rng": ckpt.rng_state(), "step": step}
