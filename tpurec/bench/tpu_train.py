"""`tpurec bench tpu-train`: DLRM-DCNv2 training samples/s on one TPU chip, tpurec against plain JAX.

The model: the `mlperf-dcnv2` config (26 tables of dim 128 with MLPerf's multi-hot sizes, 214 ids per
sample; bottom MLP 512-256-128, three low-rank cross layers of rank 512, top MLP 1024-1024-512-256-1),
its tables capped at `--rows-cap` rows each so that weights and state fit one chip
(tpurec/bench/tpu_train_shapes.py), batch `--batch` per chip, row-wise Adagrad tables, Adagrad MLPs.
Two contenders, each one process per round (a TPU is held by one process at a time), in a random
order every round (the seed is reported):
- `jax`: the same model and step in plain JAX, jitted end to end with donated buffers
  (tpurec/bench/tpu_train_jax*.py), on batches already on the device;
- `tpurec`: `tpurec train --device tpu` on the same synthetic data (tpurec/bench/tpu_train_tpurec.py),
  its host input pipeline included.
Each reports samples/s over the timed steps after warm-up and its step time; the run reports the
per-round ratio tpurec/JAX (> 1: tpurec is faster), the JAX side's HBM (parameters, state, the
chip's peak), the device and the load average. `--cpu`: a smoke run on CPU with tiny shapes (CI).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench.tpu_train_shapes import CHIP_BATCH, CPU_BATCH, CPU_ROWS_CAP, DEFAULT_ROWS_CAP, Workload
from tpurec.bench.tpu_train_split import PHASES
from tpurec.errors import UserError

CONTENDERS = ("jax", "tpurec", "split")  # split: tpurec's step in pieces, first round only (tpu_train_split.py)
# --cpu: (rows cap, batch, warm-up steps, timed steps, rounds); small dims keep JAX's compile short
CPU_RUN = (CPU_ROWS_CAP, CPU_BATCH, 2, 3, 1)
CPU_DIMS = {"dim": 16, "dense_arch": (32, 16), "over_arch": (64, 32, 1), "dcn_rank": 16}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tpu-train", help="DLRM-DCNv2 samples/s on a TPU chip: tpurec train vs plain JAX (--cpu: smoke)")
    p.add_argument("--cpu", action="store_true", help="a smoke run on CPU: tiny tables and dims, batch 64, 3 steps")
    p.add_argument("--batch", type=positive_int, default=None, help=f"batch per chip (default {CHIP_BATCH:,})")
    p.add_argument(
        "--rows-cap", type=positive_int, default=None, help=f"rows per table at most (default {DEFAULT_ROWS_CAP:,})"
    )
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per round (default 50)")
    p.add_argument("--warmup", type=positive_int, default=None, help="steps before timing (default 10)")
    p.add_argument("--rounds", type=positive_int, default=None, help="rounds, each contender once a round (default 3)")
    p.add_argument("--batches", type=positive_int, default=8, help="distinct synthetic batches cycled (default 8)")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset (default jax,tpurec,split)"
    )
    p.add_argument(
        "--tpurec-args",
        default="",
        help="more `tpurec train` flags as one string, given with =: --tpurec-args='--step compiled' (default: none)",
    )
    p.add_argument("--precision", default="default", help="JAX's default matmul precision (default: default)")
    p.add_argument(
        "--jax-feed",
        choices=("host", "device"),
        default="host",
        help="the JAX contender's batches: moved from the host each step (default, as tpurec's are) or put on "
        "the device once before the timing (no input cost: JAX's upper bound)",
    )
    p.add_argument("--work-dir", help="where the data and metrics go (kept); default: a temporary directory")
    p.add_argument("--seed", type=int, default=None, help="seed of the order of contenders (default: fresh, reported)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--tables-out",
        metavar="FILE",
        help="write the workload's tables as a `tpurec plan --tables` file and stop (nothing trains)",
    )
    p.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> tuple[Workload, int, int, int]:
    """(workload, warm-up steps, timed steps, rounds) of the flags, --cpu's defaults under them."""
    import dataclasses

    from tpurec.bench.tpu_train_shapes import workload

    cap, batch, warmup, steps, rounds = CPU_RUN if args.cpu else (DEFAULT_ROWS_CAP, CHIP_BATCH, 10, 50, 3)
    host_tier = _host_tier_of(shlex.split(args.tpurec_args))
    if host_tier and set(_contenders(args.contenders)) != {"tpurec"}:
        raise UserError("--tpurec-args' --host-tier: only tpurec keeps tables in host memory; give --contenders tpurec")
    w = workload(args.rows_cap or cap, args.batch or batch, host_tier=host_tier)
    if args.cpu:
        w = dataclasses.replace(w, **CPU_DIMS)  # type: ignore[arg-type]
    return w, args.warmup or warmup, args.steps or steps, args.rounds or rounds


def _env(cpu: bool, work: str) -> dict[str, str]:
    """A child's environment: this checkout's tpurec first; JAX's compile cache shared by the rounds."""
    from tpurec.runtime import safe_path

    root = str(Path(strict_json.__file__).resolve().parents[1])
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    extra = {"PYTHONPATH": path, "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax-cache")}
    if cpu:
        extra["JAX_PLATFORMS"] = "cpu"
    return safe_path.env({**os.environ, **extra})


def _probe(env: dict[str, str]) -> tuple[str, str]:
    """(JAX's backend, the first device's kind), asked of a child: the chip stays free for the rounds."""
    from tpurec.runtime import safe_path

    code = "import jax; print(jax.default_backend()); print(jax.devices()[0].device_kind)"
    p = subprocess.run(safe_path.python("-c", code), capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise UserError(f"JAX could not start here: {p.stderr.strip().splitlines()[-1:]}")
    backend, kind = p.stdout.strip().splitlines()[-2:]
    return backend, kind


def _child_round(
    name: str, w: Workload, warmup: int, steps: int, args: argparse.Namespace, env: dict[str, str]
) -> dict:
    """The jax or split contender's round: its module run in a child, its JSON line read back."""
    import json

    from tpurec.runtime import safe_path

    module = {"jax": "tpurec.bench.tpu_train_jax", "split": "tpurec.bench.tpu_train_split"}[name]
    cmd = ["-m", module, w.to_json(), "--warmup", str(warmup), "--steps", str(steps), "--batches", str(args.batches)]
    jax_args = ["--precision", args.precision, "--feed", args.jax_feed]
    cmd += jax_args if name == "jax" else ["--device", "cpu" if args.cpu else "tpu"]
    p = subprocess.run(safe_path.python(*cmd), capture_output=True, text=True, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"the {name} contender exited {p.returncode}", "stderr_tail": p.stderr[-3000:]}
    return dict(json.loads(lines[-1]))


def _rounds(
    w: Workload, warmup: int, steps: int, rounds: int, args: argparse.Namespace, work: str, kind: str
) -> list[dict]:
    """Every round's results, each contender once in a random order; a contender that fails is dropped."""
    from tpurec.bench.tpu_train_tpurec import run_round

    env = _env(args.cpu, work)
    contenders = _contenders(args.contenders)
    if "tpurec" in contenders:
        _make_data(w, os.path.join(work, "data"), args.batches, env)
    extra = shlex.split(args.tpurec_args)
    if "tpurec" in contenders and _step_of(extra) != "eager" and "--limits" not in extra:
        extra += ["--limits", _measure_limits(w, os.path.join(work, "data"), kind, env, work)]
    rng, out = random.Random(args.seed), []
    for k in range(rounds):
        order = list(contenders)
        rng.shuffle(order)
        rec: dict[str, Any] = {"round": k + 1, "order": order}
        for name in order:
            if name != "tpurec":
                rec[name] = _child_round(name, w, warmup, steps, args, env)
            else:
                device = "cpu" if args.cpu else "tpu"
                rec[name] = run_round(w, os.path.join(work, "data"), warmup, steps, device, extra, work)
            if not args.json:
                print(strict_json.dumps({"round": k + 1, name: _brief(rec[name])}), flush=True)
        out.append(rec)
        # the split's figures are per piece, not a contest: one round of them
        contenders = [c for c in contenders if "error" not in rec[c] and c != "split"]
    return out


def _host_tier_of(extra: list[str]) -> tuple[str, ...]:
    """The table names of a --host-tier among `tpurec train`'s extra flags (auto: refused here)."""
    from tpurec.planner import host_tier_flag

    text = _flag_value(extra, "--host-tier")
    tables = host_tier_flag.parse(text, "--host-tier") if text is not None else None
    if tables == host_tier_flag.AUTO:
        raise UserError("--tpurec-args' --host-tier: name the tables (t_C1:0.2,...); the bench checks them")
    return tuple(t.name for t in tables) if isinstance(tables, list) else ()


def _flag_value(extra: list[str], flag: str) -> str | None:
    for i, arg in enumerate(extra):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(extra):
            return extra[i + 1]
    return None


def _step_of(extra: list[str]) -> str:
    """The --step value among `tpurec train`'s extra flags ("--step X" or "--step=X"), else "eager"."""
    return _flag_value(extra, "--step") or "eager"


def _measure_limits(w: Workload, data: str, kind: str, env: dict[str, str], work: str) -> str:
    """`tpurec data stats` over the data for one device of this chip (--step compiled and pipelined
    compile with the limits fixed): the limits file's path."""
    from tpurec.runtime import safe_path

    # JAX's device_kind of one chip -> its one-chip slice (v5e: "TPU v5 lite", v6e: "TPU v6 lite")
    topology = {"cpu": "cpu-1", "tpu v5 lite": "v5e-1", "tpu v6 lite": "v6e-1"}.get(kind.lower())
    if topology is None:  # one chip of another generation: its slice name is the user's to give
        raise UserError(
            f"on a {kind} give the id limits: --tpurec-args='--step S --limits L.json' (`tpurec data stats`)"
        )
    out = os.path.join(work, "limits.json")
    cmd = ["-m", "tpurec.cli", "data", "stats", data, "--model", "mlperf-dcnv2", "--topology", topology]
    cmd += ["--batch-size", str(w.batch), "--out", out, "--quiet"]
    child = {**env, "JAX_PLATFORMS": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # host work: the chip stays free
    p = subprocess.run(safe_path.python(*cmd), capture_output=True, text=True, env=child)
    if p.returncode != 0:
        raise RuntimeError(f"measuring the id limits failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return out


def _make_data(w: Workload, out: str, batches: int, env: dict[str, str]) -> None:
    """tpu_train_tpurec.make_data in a child: its oracle AUC imports torch, which on a TPU VM may load
    TorchTPU; this process keeps away from the chip (and from torch) so the rounds can have it."""
    from tpurec.runtime import safe_path

    code = "import sys; from tpurec.bench.tpu_train_tpurec import main_make_data; main_make_data(sys.argv[1:])"
    child = {**env, "JAX_PLATFORMS": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    p = subprocess.run(
        safe_path.python("-c", code, w.to_json(), out, str(batches)), capture_output=True, text=True, env=child
    )
    if p.returncode != 0:
        raise RuntimeError(f"making the synthetic data failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def _contenders(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONTENDERS]
    if bad or not names:
        raise UserError(f"--contenders takes {', '.join(CONTENDERS)}; got {text!r}")
    return names


def _brief(r: dict) -> dict:
    keys = ("samples_per_s", "step_ms", "first_step_s", "error", "stderr_tail")
    return {k: r[k] for k in keys if k in r}


def summary(results: list[dict]) -> dict:
    """Per contender the median samples/s and step time over its rounds; tpurec/JAX per round."""
    from tpurec.bench.rounds import ratio_summary

    out: dict[str, Any] = {}
    for name in CONTENDERS:
        ok = [r[name] for r in results if name in r and "error" not in r[name]]
        errors = [r[name]["error"] for r in results if name in r and "error" in r[name]]
        if ok:
            out[name] = {
                "samples_per_s": round(statistics.median(r["samples_per_s"] for r in ok), 1),
                "step_ms": round(statistics.median(r["step_ms"] for r in ok), 3),
                "rounds": len(ok),
            }
            if name == "split":  # its pieces: where tpurec's step goes
                keys = (*PHASES, "host_build_ms", "host_copy_ms", "sum_ms", "device_ms", "device_busy_at_most")
                out[name].update({k: ok[0][k] for k in keys if k in ok[0]})
        if errors:
            out.setdefault(name, {})["error"] = errors[0]
    both = [r for r in results if all(c in r and "error" not in r[c] for c in ("jax", "tpurec"))]
    # ratio_summary takes seconds (theirs / ours): JAX's step time over tpurec's = tpurec's samples/s over JAX's
    out["ratio_tpurec_vs_jax"] = (
        ratio_summary([r["tpurec"]["step_ms"] for r in both], [r["jax"]["step_ms"] for r in both]) if both else None
    )
    # issue #59's "chip busy >= 80% of the step": the split's device pieces (drained one by one) over
    # tpurec train's own step, where the host half runs ahead on the pipeline's threads (the split's
    # undrained step does its host half inline, so its own `device_busy_at_most` reads lower)
    split, train = out.get("split", {}), out.get("tpurec", {})
    if split.get("device_ms") and train.get("step_ms"):
        out["device_share_of_train_step"] = round(min(1.0, split["device_ms"] / train["step_ms"]), 3)
    return out


def run(args: argparse.Namespace) -> int:
    from tpurec.bench.rounds import fresh_seed, load_average

    w, warmup, steps, rounds = _settings(args)
    if args.tables_out:
        from tpurec.bench.tpu_train_shapes import plan_tables

        with open(args.tables_out, "w") as f:
            f.write(strict_json.dumps(plan_tables(w), indent=1))
        print(f"wrote {len(w.rows)} tables ({w.table_bytes() / 2**30:.2f} GiB with their state) to {args.tables_out}")
        return 0
    args.seed = fresh_seed() if args.seed is None else args.seed
    with tempfile.TemporaryDirectory(prefix="tpurec-tpu-train-") as tmp:
        work = args.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        backend, kind = _probe(_env(args.cpu, work))
        if backend != "tpu" and not args.cpu:
            raise UserError(f"JAX sees no TPU here (its backend: {backend}); run on a TPU VM, or --cpu for a smoke run")
        load_before = load_average()
        results = _rounds(w, warmup, steps, rounds, args, work, "cpu" if args.cpu else kind)
    doc = {
        "device": kind,
        "platform": backend,
        "seed": args.seed,
        "workload": {**w.describe(), "rows": list(w.rows), "warmup_steps": warmup, "timed_steps": steps},
        "load_average": {"before": load_before, "after": load_average()},
        "summary": summary(results),
        "hbm_jax": _hbm(results),
        "rounds": results,
    }
    print(strict_json.dumps(doc if args.json else {k: v for k, v in doc.items() if k != "rounds"}, indent=1))
    return 1 if any("error" in r.get(c, {}) for r in results for c in CONTENDERS) else 0


def _hbm(results: list[dict]) -> dict | None:
    """The JAX side's parameters and state (bytes) and the device's own figures, from its last round."""
    ok = [r["jax"] for r in results if "jax" in r and "error" not in r["jax"]]
    if not ok:
        return None
    last = ok[-1]
    return {k: last[k] for k in ("table_bytes", "dense_bytes", "memory")}
