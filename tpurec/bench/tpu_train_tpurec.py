"""tpurec's contender in `tpurec bench tpu-train`: `tpurec train` on the capped mlperf-dcnv2 tables.

`tpurec train` takes its tables' sizes from its data (`_dataset.json`, tpurec/dlrm/data.py
`model_table_sizes`), so the caps need no flag of their own: the data are `tpurec.data.synth`'s for the
capped tables (a row group per batch, the generator and seed the JAX contender's batches come from),
and `tpurec train --data DIR --model mlperf-dcnv2` builds the model over those sizes with the MLPerf
config's architecture and multi-hot pooling. Its optimizers are set to the JAX contender's: row-wise
Adagrad for the tables (what TorchRec's DLRM example fuses into backward; the catalog's mlperf-dcnv2
default is full Adagrad), Adagrad for the MLPs, the config's learning rates and eps.

Samples/s: `tpurec train`'s own figure averages over every step, the first (compiling) one included;
here the steady figure comes from its `--metrics-out` records instead (one per step below 200 steps,
each with the seconds since the start): the samples between the record of step `warmup` and the last
one, over the seconds between them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from tpurec.bench.tpu_train_shapes import Workload
from tpurec.errors import UserError


def make_data(w: Workload, out_dir: str, batches: int) -> dict:
    """`batches` training row groups and one held out for the final evaluation; the synth summary."""
    from tpurec.bench.tpu_train_jax import data_schema
    from tpurec.data.synth import synthesize

    rows = w.batch * (batches + 1)
    made = _made(out_dir)
    if made and made.get("rows") == rows and made.get("seed") == w.seed and made.get("table_sizes") == list(w.rows):
        return made  # a --work-dir's data from an earlier run of the same shapes
    return synthesize(
        rows,
        out_dir,
        seed=w.seed,
        table_set=None,
        row_group_size=w.batch,
        show_progress=False,
        own_schema=data_schema(w),
        overwrite=True,
    )


def main_make_data(argv: list[str]) -> None:
    """make_data(Workload JSON, out dir, batches): what `tpurec bench tpu-train` runs in a child."""
    make_data(Workload.from_json(argv[0]), argv[1], int(argv[2]))


def _made(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, "_dataset.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None


def train_args(
    w: Workload, data: str, steps: int, device: str, metrics: str, batches: int, warmup: int = 0
) -> list[str]:
    """The `tpurec train` command line (after `train`) for the workload on `data`."""
    return [
        *("--data", data, "--model", "mlperf-dcnv2", "--device", device),
        *("--batch-size", str(w.batch), "--steps", str(steps), "--seed", str(w.seed)),
        # the architecture spelled out (the config's own on the chip; --cpu's smaller dims)
        *("--interaction", "dcn", "--embedding-dim", str(w.dim), "--dense-arch", _ints(w.dense_arch)),
        *("--over-arch", _ints(w.over_arch), "--dcn-num-layers", str(w.dcn_layers)),
        *("--dcn-low-rank-dim", str(w.dcn_rank)),  # the ids per sample: the data's (the planner: the table set's)
        *("--embedding-optimizer", "rowwise_adagrad", "--dense-optimizer", "adagrad"),
        *("--embedding-lr", repr(w.embedding_lr), "--dense-lr", repr(w.dense_lr), "--eps", repr(w.eps)),
        # one row group held out (make_data): the final evaluation is 1 batch, not 5% of the run
        *("--eval-every", "0", "--eval-fraction", repr(1.0 / (batches + 1))),
        *("--quiet", "--curves-out", "none", "--metrics-out", metrics),
        # a loss read (the host waits for the device) at the warm-up's end and the run's, and between
        # them no more often than every 10 steps: the host runs ahead as the JAX side's does
        *("--log-every", str(math.gcd(warmup, steps - warmup, 10) if steps > warmup else 1)),
    ]


def _ints(xs: tuple[int, ...]) -> str:
    return ",".join(map(str, xs))


def steady_rate(records: list[dict], warmup: int) -> tuple[float, float, int]:
    """(samples/s, ms per step, steps timed) between the record at step >= warmup and the last one."""
    train = [r for r in records if r.get("kind") == "train"]
    start = next((r for r in train if r["step"] >= warmup), None)
    if start is None or train[-1]["step"] <= start["step"]:
        raise RuntimeError(f"tpurec train logged no step after the {warmup} warm-up steps: {train[-3:]}")
    end = train[-1]
    secs, steps = end["seconds"] - start["seconds"], end["step"] - start["step"]
    return (end["samples"] - start["samples"]) / secs, secs / steps * 1e3, steps


def run_round(w: Workload, data: str, warmup: int, steps: int, device: str, extra: list[str], work: str) -> dict:
    """One `tpurec train` run in a child process: its figures, or {"error": ...} where it failed."""
    from tpurec import strict_json
    from tpurec.runtime import safe_path

    metrics = os.path.join(work, "tpurec-metrics.jsonl")
    Path(metrics).unlink(missing_ok=True)
    args = train_args(w, data, warmup + steps, device, metrics, _batches_of(data, w.batch), warmup) + extra
    root = str(Path(strict_json.__file__).resolve().parents[1])  # this checkout's tpurec, in the child too
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    p = subprocess.run(
        safe_path.python("-m", "tpurec.cli", "train", *args),
        capture_output=True,
        text=True,
        env=safe_path.env(PYTHONPATH=path),
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        # the first error lines too: a device failure's cause comes first, then pages of its echoes
        first = [ln for ln in p.stderr.splitlines() if "rror" in ln and "materialization" not in ln][:20]
        error = f"tpurec train exited {p.returncode}"
        return {"error": error, "stderr_first_errors": first, "stderr_tail": p.stderr[-3000:]}
    result = json.loads(lines[-1])
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    try:
        sps, step_ms, timed = steady_rate(records, warmup)
    except RuntimeError as e:  # a run too short to time: recorded like a failure, the other side goes on
        return {"error": str(e)}
    return {
        "samples_per_s": round(sps, 1),
        "step_ms": round(step_ms, 3),
        "steps_timed": timed,
        "samples_per_s_all_steps": result.get("samples_per_s"),  # tpurec train's own, compile included
        "seconds": result.get("seconds"),
        "losses": [round(r["loss"], 6) for r in records if r.get("kind") == "train"],
        # each logged step's (step, seconds since the start): with --log-every 1 a slow step stands out
        "logged_seconds": [[r["step"], round(r["seconds"], 3)] for r in records if r.get("kind") == "train"],
        # stack inputs over their fixed id limits (run in passes: other shapes, other programs) and
        # tpurec's own device->host copies a step (each a wait for the device)
        "multipass_batches": (result.get("id_limits") or {}).get("multipass_batches"),
        "device_to_host_copies_per_step": result.get("device_to_host_copies_per_step"),
        "dense": result.get("dense"),  # the arches and their update compiled or eager
        # the switches the run had (TPUREC_TC_UPDATE, TPUREC_NARROW_INPUTS, ...): which route ran
        "tpurec_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TPUREC_")},
        **({"host_tier": result["host_tier"]} if "host_tier" in result else {}),
        **({"hbm": result["hbm"]} if "hbm" in result else {}),  # the plan's HBM figure and the bytes in use
        "command": "tpurec train " + " ".join(args),
    }


def _batches_of(data: str, batch: int) -> int:
    """Training row groups of `data` (make_data's): one batch each, one more held out."""
    with open(os.path.join(data, "_dataset.json")) as f:
        rows = int(json.load(f)["rows"])
    if rows % batch or rows // batch < 2:
        raise UserError(f"{data}: {rows} rows are not 2 or more row groups of the batch {batch}")
    return rows // batch - 1
