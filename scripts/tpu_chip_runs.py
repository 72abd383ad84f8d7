"""The chip measurements the open issues wait for, each a step with its time limit, run on a lent TPU VM
(after the bundle's setup, `source .tpu-bundle/setup.sh .tpu-bundle`) with their results under $OUT.
tpurec's TPU defaults since session 36: the dense arches compiled (`tpurec train` on a real TPU, the
split contender), the table updates landed by `index_copy_` of their rows (tpu_bridge.rows_route).

- `tt` (#59): `bench tpu-train` at MLPerf shapes: tpurec vs pure JAX (interleaved), the plan's HBM
  figure beside the bytes in use (session 36 with these defaults: 254.4 ms a step, 1.29x);
- `tt-long` (#59): `tt` over 20 steps after 10 of warm-up (session 36: tpurec's steps 6-8 took ~280 ms,
  the later ones ~240; JAX's 328 from step 2);
- `tt-split` (#59): `tt-long` with the split contender too: the same-run ratio and
  `device_share_of_train_step` (#59's chip busy >= 80%) in one run;
- `tt-narrow` (#59): `tt-long` with TPUREC_NARROW_INPUTS=1 (sample ids as int16, gains as bfloat16
  where exact: fewer bytes over the host link, whose copies were 117-196 ms a step in session 37);
- `tt-steps` (#59): tt's tpurec side alone with a loss read every step (each step's seconds in
  `logged_seconds`: a recompiling batch stands out); `-eager` with `--eager-dense`, `-copy` with
  TPUREC_TC_UPDATE=copy (the new tables copied back), `-narrow` with TPUREC_NARROW_INPUTS=1 (session
  35: spikes of 7.5-28 s where their layout changed; `input_copy.WireForms` since, not rerun),
  `-foreach` with TPUREC_DENSE_FOREACH_COPY=1 (the dense update's results put back in one
  `_foreach_copy_`, not AOTAutograd's copy per tensor; session 39: a tie, 238.8 against 237.0 ms),
  `-serial` with TPUREC_HOST_THREADS=1 (each stack's CSR build and host-to-device copy in the calling thread
  one after another: whether copies from the pool's threads hold up the main thread's dispatch);
  `-nogatherpad` with TPUREC_GATHER_PAD=0 (the lookup's gather at the CSR's own count, not padded to
  one v5e gathers fast: tensorcore/gather_count.py) and `-s40pool` with session 40's pooling (one
  output copy, the gains in a pass over the rows), each against session 41's defaults in `tt-steps`;
  `-updatepad` with TPUREC_UPDATE_PAD=1 (the update's rows padded to a fast gather count, opt-in);
  `tt-foreach`: tt-long with the foreach copy-back;
- `split` (#59): its split contender alone: the step's pieces (host build and copies, lookup, dense,
  update) and the device's bytes in use after each (`device_bytes_by_piece`); `-eager`
  (TPUREC_SPLIT_COMPILE_DENSE=0), `-copy`, `-narrow` as above; `-xla` with TPUREC_NO_PALLAS=1 (XLA's
  segment sum for the lookup's pooling: at MLPerf's 1.6M-slot stack tpurec's lookup took 47 ms against
  the pure-JAX `take` + sum's 29, session 32); `-merge` with TPUREC_PALLAS_MERGE=1 (the update's row
  gradients summed by `pallas_merge`, not XLA's gather and segment sum: the update is 132 ms of ~240);
- `host` (#60): `bench host-tier --device tpu` at a 20% cache with `--pinned` (pageable and pinned
  host memory for the row copies, interleaved), Zipf ids drawn once for the run;
- `link` (#60): chip probe 11 (`scripts/tpu_probe_host_link.py`), the host link's raw rates (session
  35: ~240 MB/s by every route);
- `inplace` (#59): chip probe 12 (`scripts/tpu_probe_inplace.py`): the table update landed by a copy,
  by `index_copy_` of the updated rows only, or donated and `set_`, on a 1 GiB stack, and whether a
  state_dict view taken before sees the update;
- `compiled` (#59): `bench tpu-train --contenders tpurec --tpurec-args='--step compiled'` with
  TPUREC_STEP_ON_TPU=1 (session 34: it runs, 462.8 ms a step against eager's 325.9, the host half not
  overlapped; `step_ahead` since); `pipelined` the same with `--step pipelined` (not yet run on a chip);
- `update` (#59): chip probe 10 (`scripts/tpu_probe_update.py`) at the 1.1x id limits: the row-wise
  Adagrad update program (copy and rows routes, donated), its pieces (decode, gradient rows, segment sum,
  distinct rows, apply), the pure-JAX update's, at MLPerf's biggest stack (session 31's run: apply 78 ms);
- `dense-bags` (#59): chip probe 13 (`scripts/tpu_probe_dense_bags.py`): the lookup from bag-major ids
  (a fixed-axis sum after the gather) against `bench tpu-kernels`' XLA contender and tpurec's kernel;
- `gather` (#59): chip probe 14 (`scripts/tpu_probe_gather_shapes.py`): `jnp.take`'s time against the
  number of ids (powers of two and not), the index mode, two half gathers and sorted ids;
- `lookup-pool` (#59): chip probe 15 (`scripts/tpu_probe_lookup_pool.py`): the TensorCore lookup's
  decode + gather and its pooling alone, and the Pallas pooling's options (row tiles, no padding copy);
- `gather-sweep` (#59): probe 14 at width 128 over sizes near 2^17 and the MLPerf stack's 2.1M slots,
  `jnp.take` and clamped indexing only: which id counts take the gather's fast path;
- `update-copies` (#59): chip probe 16 (`scripts/tpu_probe_update_copies.py`): does the TPU compiler copy
  the donated table in `bench tpu-kernels`' update programs (both sides grew with the table)?
- `gather-placement` (#59): probe 14 with the table placed 4 ways per size (the same ids): is the
  gather's speed (two speeds in session 40's sweep) the id count's or the buffers' placement's?
  (The count's, session 41.) `scatter-rule`: does XLA's scatter follow the gather's count rule?
- `kernels` (#59): `bench tpu-kernels` on five cells (width 128 and 16, pooling 32, Zipf, 4M rows):
  the kernel's lookup and updates against plain JAX since the unique-id limit and one-copy inputs.

Each tpurec step writes `<step>.json` (its stdout) under $OUT, each probe its own JSON and its stdout to
the shared `probes.log`; stderr tails and start/end times go to
$OUT/runs.log (the device returns at most 8 files). Steps run in the order given, each under its own
time limit; one call of the device tool runs at most 600 s, so give each call the steps that fit:

    python3 scripts/tpu_chip_runs.py tt-split               # ~480 s: the ratio and the chip's busy share
    python3 scripts/tpu_chip_runs.py tt-narrow              # ~400 s: the ratio with the inputs narrowed
    python3 scripts/tpu_chip_runs.py split-merge split-xla  # ~2 x 120 s: the update's and lookup's options
    python3 scripts/tpu_chip_runs.py tt-steps tt-steps-narrow  # ~2 x 170 s
    python3 scripts/tpu_chip_runs.py tt-steps tt-steps-serial  # ~2 x 170 s: the host threads A/B
    python3 scripts/tpu_chip_runs.py tt-steps-nogatherpad tt-steps  # ~2 x 170 s: the gather-count padding A/B
    python3 scripts/tpu_chip_runs.py tt-steps-s40pool tt-steps  # ~2 x 170 s: session 40's pooling A/B
    python3 scripts/tpu_chip_runs.py compiled               # ~170 s (session 34; step_ahead since)
    python3 scripts/tpu_chip_runs.py update                 # ~200 s: the table update's pieces
    python3 scripts/tpu_chip_runs.py dense-bags             # ~150 s: a bag-major lookup against XLA's
    python3 scripts/tpu_chip_runs.py gather                 # ~60 s: the row gather against its shape
    python3 scripts/tpu_chip_runs.py lookup-pool            # the lookup's pieces and pooling options
    python3 scripts/tpu_chip_runs.py gather-sweep           # the gather at sizes near 2^17 and the MLPerf stack's
    python3 scripts/tpu_chip_runs.py gather-placement       # ~90 s: size rule or placement (first, session 41)
    python3 scripts/tpu_chip_runs.py scatter-rule           # ~60 s: the gather's count rule for XLA's scatter?
    python3 scripts/tpu_chip_runs.py kernels kernels-updatepad  # ~2 x 150 s: the update's padded rows A/B
    python3 scripts/tpu_chip_runs.py update-copies          # ~90 s: a table copy in the update programs?
    python3 scripts/tpu_chip_runs.py kernels                # the kernels matrix (~150 s, session 40)
    python3 scripts/tpu_chip_runs.py --dry-run              # the commands, nothing run
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


# probe 14's sweep: ids a gather near 2^17 (130,396 and 131,080 took 0.58 ms, 131,064 and 131,072 1.36 ms
# at 1M x 128 in session 40) and near the MLPerf stack's 2.13M slots
GATHER_SWEEP = ",".join(
    str(n)
    for n in (126976, 129024, 130048, 130560, 130944, 131000, 131064, 131068, 131070, 131071, 131072)
    + (131073, 131076, 131080, 131088, 131200, 132096, 2000000, 2097152, 2127792, 2127800)
)
TT = "/tmp/tpurec-tt"  # the tt-steps steps' data, made once, kept off $OUT (the machine is not kept)


def steps(out: str) -> dict[str, Step]:
    train = ["bench", "tpu-train", "--json", "--rounds", "1", "--steps", "10", "--warmup", "5"]
    long = [*train[:5], "--steps", "20", "--warmup", "10"]
    tsteps = [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1", "--work-dir", TT]
    kernels = ["bench", "tpu-kernels", "--json", "--cells", "0,3,5,6,8", "--rounds", "3", "--reps", "5", "--seed", "1"]
    return {
        "tt": Step(420, [*train, "--contenders", "jax,tpurec", "--work-dir", f"{out}/w"], scratch="w"),
        # 10 warm-up steps and 20 timed: tpurec's steps 6-8 took ~280 ms and those after ~240 in session
        # 36 (JAX's the same from step 2): the steady step of both, over the same steps
        "tt-long": Step(480, [*long, "--contenders", "jax,tpurec", "--work-dir", f"{out}/w"], scratch="w"),
        "tt-split": Step(560, [*long, "--contenders", "jax,tpurec,split", "--work-dir", f"{out}/w"], scratch="w"),
        # tt-long with the inputs narrowed (TPUREC_NARROW_INPUTS=1: ~42 -> ~29 MB a step over a ~240 MB/s
        # host link, session 35): the host copies took 117-196 ms of tpurec's 258 ms step in session 37
        "tt-narrow": Step(
            480,
            [*long, "--contenders", "jax,tpurec", "--work-dir", f"{out}/w"],
            env={"TPUREC_NARROW_INPUTS": "1"},
            scratch="w",
        ),
        "tt-steps": Step(300, tsteps),
        "tt-steps-eager": Step(
            300, [*train, "--contenders", "tpurec", "--tpurec-args=--log-every 1 --eager-dense", "--work-dir", TT]
        ),
        "tt-steps-copy": Step(300, tsteps, env={"TPUREC_TC_UPDATE": "copy"}),
        "tt-steps-narrow": Step(300, tsteps, env={"TPUREC_NARROW_INPUTS": "1"}),
        "tt-steps-foreach": Step(300, tsteps, env={"TPUREC_DENSE_FOREACH_COPY": "1"}),
        "tt-steps-serial": Step(300, tsteps, env={"TPUREC_HOST_THREADS": "1"}),
        # session 41's defaults off, one at a time: the lookup's gather at the CSR's own count, and
        # session 40's pooling (one output copy, the gains in a pass over the gathered rows)
        "tt-steps-nogatherpad": Step(300, tsteps, env={"TPUREC_GATHER_PAD": "0"}),
        "tt-steps-s40pool": Step(300, tsteps, env={"TPUREC_POOL_GAINS": "0", "TPUREC_POOL_ACCUMULATORS": "1"}),
        # the update's rows padded to a count the gather runs fast at (opt-in until `scatter-rule`)
        "tt-steps-updatepad": Step(300, tsteps, env={"TPUREC_UPDATE_PAD": "1"}),
        # tt-long with the dense update's results put back by one _foreach_copy_ (session 38: 271.0 ms
        # in its one run, against 252.9 without two runs earlier; the windows of 10 steps 242-297 ms)
        "tt-foreach": Step(
            480,
            [*long, "--contenders", "jax,tpurec", "--work-dir", f"{out}/w"],
            env={"TPUREC_DENSE_FOREACH_COPY": "1"},
            scratch="w",
        ),
        **{
            f"split{suffix}": Step(
                300,
                [*train, "--contenders", "split", "--work-dir", f"{out}/ws{suffix}"],
                env=env,
                scratch=f"ws{suffix}",
            )
            for suffix, env in {
                "": {},
                "-eager": {"TPUREC_SPLIT_COMPILE_DENSE": "0"},
                "-copy": {"TPUREC_TC_UPDATE": "copy"},
                "-narrow": {"TPUREC_NARROW_INPUTS": "1"},
                "-xla": {"TPUREC_NO_PALLAS": "1"},
                "-merge": {"TPUREC_PALLAS_MERGE": "1"},
            }.items()
        },
        "host": Step(
            400,
            ["bench", "host-tier", "--device", "tpu", "--seed", "7", "--steps", "10", "--warmup", "60"]
            + ["--dists", "zipf", "--load-factors", "0.2", "--pinned", "--json"],
        ),
        "link": Step(250, ["scripts/tpu_probe_host_link.py"], script=True),
        "inplace": Step(200, ["scripts/tpu_probe_inplace.py"], script=True),
        # the table update's pieces at MLPerf's biggest stack (131 ms of tpurec's 258 ms step, session 37)
        "update": Step(300, ["scripts/tpu_probe_update.py", "--limits", "1.1", "--budget-s", "240"], script=True),
        "dense-bags": Step(300, ["scripts/tpu_probe_dense_bags.py"], script=True),
        "gather": Step(300, ["scripts/tpu_probe_gather_shapes.py"], script=True),
        "lookup-pool": Step(300, ["scripts/tpu_probe_lookup_pool.py"], script=True),
        "gather-placement": Step(
            240,
            ["scripts/tpu_probe_gather_shapes.py", "--forms", "index_clip", "--placements", "4"]
            + ["--sizes", "130944,131000,131072,131080,2000000,2097152", "--out", f"{out}/gather_placement.json"],
            script=True,
        ),
        "update-copies": Step(240, ["scripts/tpu_probe_update_copies.py"], script=True),
        # does XLA's scatter (the update programs') follow the gather's count rule? (session 41's rule:
        # 130,945 / 131,072 / 2,127,799 slow, 130,943 / 131,073 / 2,127,873 fast for the gather)
        "scatter-rule": Step(
            240,
            ["scripts/tpu_probe_gather_shapes.py", "--forms", "index_clip,scatter_add", "--rounds", "3"]
            + ["--reps", "8", "--sizes", "130943,130945,131072,131073,2127799,2127873"]
            + ["--out", f"{out}/scatter_rule.json"],
            script=True,
        ),
        "gather-sweep": Step(
            240,
            [
                "scripts/tpu_probe_gather_shapes.py",
                "--forms",
                "take_fill,index_clip",
                "--out",
                f"{out}/gather_sweep.json",
            ]
            + ["--sizes", GATHER_SWEEP],
            script=True,
        ),
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
        "kernels": Step(420, kernels),
        "kernels-updatepad": Step(420, kernels, env={"TPUREC_UPDATE_PAD": "1"}),
    }


def command(step: Step) -> list[str]:
    return [sys.executable, *step.argv] if step.script else [*TPUREC, *step.argv]


def run(name: str, step: Step, out: Path) -> int:
    log = out / "runs.log"
    with open(log, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} start: {' '.join(command(step))}\n")
    env = dict(os.environ, **step.env)
    # A probe writes its own JSON (--out): its stdout, progress lines, goes to one shared probes.log,
    # not a file a step (the device returns at most 8 files a call). A tpurec command's is its result.
    path = out / ("probes.log" if step.script else f"{name}.json")
    with open(path, "a" if step.script else "w") as stdout:
        if step.script:
            stdout.write(f"== {name}\n")
            stdout.flush()
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
