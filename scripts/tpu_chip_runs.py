"""The chip measurements the open issues wait for, each a step with its time limit, run on a lent TPU VM
(after the bundle's setup, `source .tpu-bundle/setup.sh .tpu-bundle`) with their results under $OUT:

- `tt` (#59): `bench tpu-train` at MLPerf shapes: tpurec vs pure JAX (interleaved), the plan's HBM
  figure beside the bytes in use;
- `tt-steps`, `tt-steps-narrow` (#59): tt's tpurec side alone with a loss read every step (each step's
  seconds in `logged_seconds`, slow ones in `slow_steps`: a recompiling batch stands out), with the
  inputs in their own dtypes (the default since session 35) and narrow (TPUREC_NARROW_INPUTS=1; session
  35: 1,167 ms a step with them, spikes of 7.5-28 s where their layout changed, 307.0 without;
  `input_copy.WireForms` since, not rerun);
- `tt-steps-dense` (#59): `tt-steps` with `--compile-dense` (the DCNv2 arches as compiled programs, the
  embeddings eager: dense_compile.py; the eager dense half took 62.5 ms a step in session 35's split);
- `split` (#59): its split contender alone: the step's pieces (host build and copies, lookup, dense,
  update) and the device's bytes in use after each (`device_bytes_by_piece`);
- `split-narrow` (#59): `split` with TPUREC_NARROW_INPUTS=1 (~29 MB of inputs a step against ~42):
  what the narrow inputs save of `host_copy_ms`;
- `host` (#60): `bench host-tier --device tpu` at a 20% cache with `--pinned` (pageable and pinned
  host memory for the row copies, interleaved), Zipf ids drawn once for the run;
- `link` (#60): chip probe 11 (`scripts/tpu_probe_host_link.py`), the host link's raw rates, pageable
  and pinned, through JAX too, and the tier's copies piece by piece (session 35: ~240 MB/s by every
  route; TorchTPU's batched transfers refuse rank-2 tensors; DLPack refused both ways);
- `inplace` (#59): chip probe 12 (`scripts/tpu_probe_inplace.py`): the table update landed by a copy
  (today), by `index_copy_` of the updated rows only, or donated and `set_`, on a 1 GiB stack, and
  whether a state_dict view taken before sees the update: what ~38 ms of the step's copies could save;
- `compiled` (#59): `bench tpu-train --contenders tpurec --tpurec-args='--step compiled'` with
  TPUREC_STEP_ON_TPU=1 (session 34: it runs, 462.8 ms a step against eager's 325.9, the host half not
  overlapped; `step_ahead` since);
- `pipelined` (#59): the same with `--step pipelined` (SparseCore forward ahead, update behind), not
  yet run on a chip;
- `split-rows`, `tt-steps-rows` (#59): `split` and `tt-steps` with TPUREC_TC_UPDATE=rows (the table
  updates landed by `index_copy_` of their rows, no table-sized copies: tpu_bridge.rows_route), after
  `inplace` says TorchTPU's `index_copy_` does not copy the table;
- `tt-steps-rows-dense` (#59): `tt-steps-dense` with TPUREC_TC_UPDATE=rows (both levers at once);
- `tt-dense`, `tt-dense-rows` (#59): `tt` with `--compile-dense` (and the rows route): the same-run
  ratio against pure JAX with the levers that won;
- `split-xla` (#59): `split` with TPUREC_NO_PALLAS=1 (XLA's segment sum for the lookup's pooling):
  the Pallas pooling won at 131k slots (session 28); at MLPerf's 1.6M-slot stack tpurec's lookup took
  47 ms against the pure-JAX `take` + sum's 29 (session 32): which pooling the big stacks want;
- `split-dense` (#59): `split` with its arches compiled (TPUREC_SPLIT_COMPILE_DENSE=1, as `tpurec
  train --compile-dense` compiles them): `dense_ms` against the eager 62.5;
- `kernels` (#59): `bench tpu-kernels` on five cells (width 128 and 16, pooling 32, Zipf, 4M rows):
  the kernel's lookup and updates against plain JAX since the unique-id limit and one-copy inputs.

Each step writes `<step>.json` (stdout) under $OUT; stderr tails and start/end times go to
$OUT/runs.log (the device returns at most 8 files). Steps run in the order given, each under its own
time limit; one call of the device tool runs at most 600 s, so give each call the steps that fit:

    python3 scripts/tpu_chip_runs.py tt-steps tt-steps-dense  # ~200 + ~150 s: the baseline, --compile-dense
    python3 scripts/tpu_chip_runs.py inplace split split-rows  # ~60 + 2 x ~125 s: the update's copies
    python3 scripts/tpu_chip_runs.py split-xla tt-steps-rows  # ~125 + ~150 s
    python3 scripts/tpu_chip_runs.py tt                  # ~380 s (session 35: 383 with the setup)
    python3 scripts/tpu_chip_runs.py compiled            # ~170 s (session 34; step_ahead since)
    python3 scripts/tpu_chip_runs.py kernels             # the kernels matrix (not run since session 30)
    python3 scripts/tpu_chip_runs.py --dry-run           # the commands, nothing run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TPUREC = [sys.executable, "-m", "tpurec.cli"]


@dataclass(frozen=True)
class Step:
    limit_s: int
    argv: list[str]  # after `python -m tpurec.cli`, or a script's path and its flags
    env: dict[str, str] = field(default_factory=dict)
    script: bool = False  # argv[0] is a script of this repository, not a tpurec command
    scratch: str | None = None  # a work directory under $OUT, removed after the step (its data, caches)


TT = "/tmp/tpurec-tt"  # the tt-steps steps' data, made once, kept off $OUT (the machine is not kept)


def steps(out: str) -> dict[str, Step]:
    train = ["bench", "tpu-train", "--json", "--rounds", "1", "--steps", "10", "--warmup", "5"]
    return {
        "tt": Step(420, [*train, "--contenders", "jax,tpurec", "--work-dir", f"{out}/w"], scratch="w"),
        # tt's tpurec side alone, a loss read every step (its seconds per step in `logged_seconds`):
        # session 35's tt gave it 2,243 ms a step where session 34's gave 325.9; `-plain` without the
        # narrow inputs and the threaded builds of session 34 (the suspects), on the same data
        "tt-steps": Step(300, [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1", "--work-dir", TT]),
        "tt-steps-narrow": Step(
            300,
            [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1", "--work-dir", TT],
            env={"TPUREC_NARROW_INPUTS": "1"},
        ),
        "tt-steps-dense": Step(
            300, [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1 --compile-dense", "--work-dir", TT]
        ),
        "tt-steps-rows-dense": Step(
            300,
            [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1 --compile-dense", "--work-dir", TT],
            env={"TPUREC_TC_UPDATE": "rows"},
        ),
        # tt with session 36's levers: the arches compiled, and with `-rows` the update's rows landed in place
        "tt-dense": Step(
            480,
            [*train, "--contenders", "jax,tpurec", "--tpurec-args=--compile-dense", "--work-dir", f"{out}/w"],
            scratch="w",
        ),
        "tt-dense-rows": Step(
            480,
            [*train, "--contenders", "jax,tpurec", "--tpurec-args=--compile-dense", "--work-dir", f"{out}/w"],
            env={"TPUREC_TC_UPDATE": "rows"},
            scratch="w",
        ),
        "split": Step(300, [*train, "--contenders", "split", "--work-dir", f"{out}/ws"], scratch="ws"),
        "host": Step(
            400,
            ["bench", "host-tier", "--device", "tpu", "--seed", "7", "--steps", "10", "--warmup", "60"]
            + ["--dists", "zipf", "--load-factors", "0.2", "--pinned", "--json"],
        ),
        "link": Step(250, ["scripts/tpu_probe_host_link.py"], script=True),
        "inplace": Step(200, ["scripts/tpu_probe_inplace.py"], script=True),
        "compiled": Step(
            430,
            [*train, "--contenders", "tpurec", "--tpurec-args=--step compiled", "--work-dir", f"{out}/wc"],
            env={"TPUREC_STEP_ON_TPU": "1"},
            scratch="wc",
        ),
        "pipelined": Step(
            430,
            [*train, "--contenders", "tpurec", "--tpurec-args=--step pipelined", "--work-dir", f"{out}/wp"],
            env={"TPUREC_STEP_ON_TPU": "1"},
            scratch="wp",
        ),
        "split-narrow": Step(
            300,
            [*train, "--contenders", "split", "--work-dir", f"{out}/wsn"],
            env={"TPUREC_NARROW_INPUTS": "1"},
            scratch="wsn",
        ),
        "split-rows": Step(
            300,
            [*train, "--contenders", "split", "--work-dir", f"{out}/wsr"],
            env={"TPUREC_TC_UPDATE": "rows"},
            scratch="wsr",
        ),
        "tt-steps-rows": Step(
            300,
            [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1", "--work-dir", TT],
            env={"TPUREC_TC_UPDATE": "rows"},
        ),
        "split-xla": Step(
            300,
            [*train, "--contenders", "split", "--work-dir", f"{out}/wsx"],
            env={"TPUREC_NO_PALLAS": "1"},
            scratch="wsx",
        ),
        "split-dense": Step(
            300,
            [*train, "--contenders", "split", "--work-dir", f"{out}/wsd"],
            env={"TPUREC_SPLIT_COMPILE_DENSE": "1"},
            scratch="wsd",
        ),
        "kernels": Step(
            420,
            ["bench", "tpu-kernels", "--json", "--cells", "0,3,5,6,8", "--rounds", "3", "--reps", "5", "--seed", "1"],
        ),
    }


def command(step: Step) -> list[str]:
    return [sys.executable, *step.argv] if step.script else [*TPUREC, *step.argv]


def run(name: str, step: Step, out: Path) -> int:
    log = out / "runs.log"
    with open(log, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} start: {' '.join(command(step))}\n")
    env = dict(os.environ, **step.env)
    with open(out / f"{name}.json", "w") as stdout:
        try:
            cmd, limit = command(step), step.limit_s
            done = subprocess.run(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=limit)
            rc, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired as ex:
            rc, err = 124, (ex.stderr.decode() if isinstance(ex.stderr, bytes) else ex.stderr) or ""
    if step.scratch:
        shutil.rmtree(out / step.scratch, ignore_errors=True)
    with open(log, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} rc={rc}; stderr's end:\n{err[-4000:]}\n")
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("names", nargs="*", help="steps to run, in order (default: all, in the order listed)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    out = Path(os.environ.get("OUT") or ".")
    table = steps(str(out))
    names = a.names or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {list(table)}")
    if a.dry_run:
        for n in names:
            s = table[n]
            env = " ".join(f"{k}={v}" for k, v in s.env.items())
            print(f"{n} ({s.limit_s} s): {env} {' '.join(command(s))}".replace("  ", " "))
        return 0
    return max(run(n, table[n], out) for n in names)


if __name__ == "__main__":
    sys.exit(main())
