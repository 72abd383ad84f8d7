"""`tpurec bench zch`: managed-collision tables (`tpurec train --zch`) against the modulo hash, by AUC.

Both sides train the same model (the same table sizes, from the model config) on the same raw-id data
with the same seed, one `tpurec train` run each: the modulo side hashes every raw id into its table at
read time (1 + id mod (rows - 1), as `tpurec data convert` does), the zch side gives the rows to the ids
TorchRec's MCH remap keeps (`--zch-eviction`, one side per policy given), the rest sharing a row. Without
`--data` the data are made first by `tpurec data synth --raw-ids` (Zipf-skewed raw ids over an id space
much larger than the tables), in a temporary directory. The report: each side's eval AUC, NE and log
loss, the zch sides' remap figures, the AUC difference, the data's oracle AUC and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from tpurec import strict_json
from tpurec.argtypes import positive_float, positive_int, step_interval
from tpurec.data.catalog import MODEL_NAMES
from tpurec.errors import UserError

POLICIES = ("lru", "lfu", "distance_lfu")  # tpurec.dlrm.zch.POLICIES (not imported: `--help` stays light)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zch", help="AUC of managed-collision tables (train --zch) vs the modulo hash, same sizes")
    p.add_argument("--data", metavar="DIR", help="raw-id data (data convert/synth --raw-ids); default: synthesized")
    p.add_argument(
        "--rows", type=positive_int, default=200_000, help="rows to synthesize without --data (default 200000)"
    )
    p.add_argument(
        "--id-space", type=positive_int, default=None, help="synthesized raw ids per feature (default 2**32)"
    )
    p.add_argument("--model", choices=MODEL_NAMES, default="dlrm-tiny", help="named config (default dlrm-tiny)")
    p.add_argument("--epochs", type=positive_float, default=1.0, help="epochs each side trains (default 1)")
    p.add_argument("--batch-size", type=positive_int, default=512, help="batch per rank (default 512)")
    p.add_argument("--nproc", type=positive_int, default=1, help="ranks of each training run (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of both runs (default 0)")
    p.add_argument(
        "--eviction", nargs="+", choices=POLICIES, default=["lru"], help="zch sides, one per policy (default lru)"
    )
    p.add_argument("--eviction-interval", type=step_interval, default=None, help="--zch-eviction-interval (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=run)


def train_json(args: list[str], what: str) -> dict:
    """`tpurec train ARGS` in a child process: its result line. A failure raises RuntimeError naming
    `what`, with the tail of its stderr."""
    from tpurec.runtime import safe_path

    # the child trains with this process's tpurec (a checkout on PYTHONPATH or the installed one)
    root = str(Path(strict_json.__file__).resolve().parents[1])
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    p = subprocess.run(
        safe_path.python("-m", "tpurec.cli", "train", *args),
        capture_output=True,
        text=True,
        env=safe_path.env(OMP_NUM_THREADS="1", PYTHONPATH=path),
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def _side(result: dict) -> dict:
    out = {k: result[k] for k in ("auc", "ne", "logloss", "accuracy", "steps", "samples_per_s", "seconds")}
    if "zch" in result:
        out["remap"] = result["zch"]
    return out


def run_bench(args: argparse.Namespace, data: str, label: str | None = None) -> dict:
    """Both sides on `data` (reported as `label`, default its path); the report's dict."""
    from tpurec.bench.rounds import load_average
    from tpurec.data.schema import dataset_metadata

    meta = dataset_metadata(data)
    common = ["--data", data, "--model", args.model, "--epochs", f"{args.epochs:g}"]
    common += ["--batch-size", str(args.batch_size), "--seed", str(args.seed), "--nproc", str(args.nproc)]
    common += ["--quiet", "--curves-out", "none"]
    load_start = load_average()
    sides = {"modulo": _side(train_json(common, "the modulo side"))}
    for policy in args.eviction:
        extra = ["--zch", "--zch-eviction", policy]
        if args.eviction_interval:
            extra += ["--zch-eviction-interval", str(args.eviction_interval)]
        sides[f"zch_{policy}"] = _side(train_json(common + extra, f"the zch side ({policy})"))
    modulo_auc = sides["modulo"]["auc"]
    return {
        "data": label or os.path.abspath(data),
        "rows": meta.get("rows"),
        "raw_id_space": meta.get("raw_id_space"),
        "oracle_auc": meta.get("oracle_auc"),
        "model": args.model,
        "epochs": args.epochs,
        "batch_size_per_rank": args.batch_size,
        "nproc": args.nproc,
        "seed": args.seed,
        "sides": sides,
        "auc_gain_vs_modulo": {
            name: (None if s["auc"] is None or modulo_auc is None else round(s["auc"] - modulo_auc, 6))
            for name, s in sides.items()
            if name != "modulo"
        },
        "load_average": {"start": load_start, "end": load_average()},
    }


def _synth(args: argparse.Namespace, out: str) -> None:
    from tpurec.data.synth import RAW_ID_SPACE, synthesize

    synthesize(
        args.rows,
        out,
        seed=args.seed,
        table_set=args.model,
        show_progress=False,
        overwrite=True,
        raw_ids=True,
        id_space=args.id_space or RAW_ID_SPACE,
    )


def format_text(r: dict) -> str:
    lines = [
        f"managed-collision tables vs modulo hash: {r['model']}, {r['rows']:,} rows of raw ids "
        f"({r['data']}),\n  {r['epochs']:g} epoch(s), batch {r['batch_size_per_rank']}/rank x {r['nproc']} rank(s), "
        f"oracle AUC {r['oracle_auc']}, load average {r['load_average']['start']} -> {r['load_average']['end']}"
    ]
    for name, s in r["sides"].items():
        line = f"  {name:<18} AUC {s['auc']:.4f}  NE {s['ne']:.4f}  logloss {s['logloss']:.4f}  ({s['seconds']:.0f} s)"
        if name in r["auc_gain_vs_modulo"]:
            z = s["remap"]
            line += (
                f"  AUC {r['auc_gain_vs_modulo'][name]:+.4f} vs modulo; remap hit rate {z['hit_rate']:.1%}, "
                f"{z['evictions']:,} evictions, occupancy {z['occupancy']:.1%}"
            )
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.data:
        from tpurec.dlrm.zch import data_problem

        problem = data_problem(args.data)
        if problem:
            raise UserError(problem.replace("--zch trains", "tpurec bench zch trains", 1))
        result = run_bench(args, args.data)
    else:
        with tempfile.TemporaryDirectory(prefix="tpurec-bench-zch-") as tmp:
            _synth(args, str(Path(tmp) / "data"))
            space = args.id_space or 2**32
            label = f"synthesized: tpurec data synth --raw-ids --id-space {space} --rows {args.rows} --seed {args.seed}"
            result = run_bench(args, str(Path(tmp) / "data"), label)
    print(strict_json.dumps(result, indent=1) if args.json else format_text(result))
    return 0
