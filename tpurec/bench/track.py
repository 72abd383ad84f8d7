"""`tpurec bench track`: does tpurec's DMP train as stock TorchRec's does over a long run?

Not a speed figure: the two sides of `tpurec bench train` that share a plan (`torchrec-tw`, stock
TorchRec's DMP on FBGEMM's `fused` kernel, and `tpurec-tw`, tpurec's DMP on the SparseCore kernel's
CPU step; tables placed whole round-robin over the ranks) train the same model from the same tables
(`bench.train.start_tables`) on the same batches through TorchRec's `TrainPipelineSparseDist`, each
in its own `torch.distributed.run` job, and report every step's loss (mean over ranks) and, after
the last step, AUC over held-out batches. The report: the largest per-step loss difference, the
first step whose losses differ at all and the first beyond `--tolerance`, and both AUCs.

Workload `kaggle-100k` (default): the Criteo Kaggle cardinalities capped at 100,000 rows, dim 64,
DLRM-DCNv2 as `bench train`'s kaggle-1m (3 low-rank cross layers), the DLRM config's default
hyper-parameters (row-wise Adagrad fused into backward, Adagrad MLPs), batch 512 per rank, 200
steps, 20 eval batches per rank, on `tpurec.data.synth`'s criteo-kaggle data folded into the capped
tables. `tiny`: dlrm-tiny.

`--layout` runs tpurec's side on the SparseCore layout path (`TPUREC_NO_DIRECT=1`, the order a TPU
sums in) instead of the direct CPU step, to show how far that order drifts from FBGEMM's
(docs/dmp.md, "Numbers over long runs").
"""

from __future__ import annotations

import argparse
import sys

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench import rounds
from tpurec.bench.train import prepare_side, torchrun_json

SIDES = ("torchrec-tw", "tpurec-tw")
DCN = {
    "interaction": "dcn",
    "embedding_dim": 64,
    "dense_arch": (256, 64),
    "over_arch": (512, 256, 1),
    "dcn_num_layers": 3,
    "dcn_low_rank_dim": 64,
}
# workload -> (model config, row cap, config overrides, batch per rank, steps, eval batches per rank)
WORKLOADS = {
    "kaggle-100k": ("criteo-kaggle", 100_000, DCN, 512, 200, 20),
    "tiny": ("dlrm-tiny", None, {}, 256, 100, 10),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("track", help="long-run conformance: per-step losses and AUC, tpurec DMP vs stock TorchRec")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--tables", choices=tuple(WORKLOADS), default="kaggle-100k", help="workload (default kaggle-100k)")
    p.add_argument("--nproc", type=positive_int, default=1, help="ranks (default 1)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (default 200; tiny 100)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="batch per rank (default 512; tiny 256)")
    p.add_argument("--eval-batches", type=positive_int, default=None, help="held-out batches per rank (default 20)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="per-step loss difference allowed (default 1e-4)")
    p.add_argument("--layout", action="store_true", help="tpurec's side on the layout path (the TPU's order)")
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    _, _, _, batch, steps, evals = WORKLOADS[args.tables]
    from tpurec.dlrm.data import synth_cache_problem

    args.batch_size = args.batch_size or batch
    args.steps = args.steps or steps
    args.eval_batches = args.eval_batches or evals
    rows = _rows(args.nproc, args.steps, args.eval_batches, args.batch_size)
    problem = synth_cache_problem(_table_set(args.tables), rows, 0)
    if problem:
        print(f"tpurec bench track: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run(
            args.tables, args.nproc, args.steps, args.batch_size, args.eval_batches, args.tolerance, args.layout
        )
    except RuntimeError as e:
        print(f"tpurec bench track: error: {e}", file=sys.stderr)
        return 1
    print(strict_json.dumps(result, indent=2) if args.json else format_text(result))
    return 0


def _table_set(tables: str) -> str:
    from tpurec.dlrm.configs import get_config

    return get_config(WORKLOADS[tables][0]).table_set


def _rows(nproc: int, steps: int, evals: int, batch_size: int) -> int:
    return max(100_000, int((steps + evals) * batch_size * nproc * 1.1) + 1)  # 10% to spare (as bench train)


def run(
    tables: str = "kaggle-100k",
    nproc: int = 1,
    steps: int = 200,
    batch_size: int = 512,
    eval_batches: int = 20,
    tolerance: float = 1e-4,
    layout: bool = False,
) -> dict:
    from tpurec.dlrm.data import ensure_synth

    rows = _rows(nproc, steps, eval_batches, batch_size)
    data = ensure_synth(_table_set(tables), rows, 0, say=lambda m: print(m, file=sys.stderr))
    load_start = rounds.load_average()
    args = ["--tables", tables, "--data", str(data), "--steps", str(steps), "--batch-size", str(batch_size)]
    args += ["--eval-batches", str(eval_batches)]
    sides = {}
    for side in SIDES:
        extra = ["--layout"] if layout and side == "tpurec-tw" else []
        sides[side] = torchrun_json("tpurec.bench.track", nproc, ["--side", side, *args, *extra], f"{side} side")
    stock, ours = sides["torchrec-tw"], sides["tpurec-tw"]
    if stock["inputs"] != ours["inputs"]:
        raise RuntimeError(f"unequal work: the sides trained on different inputs {stock['inputs']} {ours['inputs']}")
    if stock["start_tables"] != ours["start_tables"]:
        # float64 sums of the same draws over the same shards: equal bit for bit under one plan
        raise RuntimeError(f"unequal start: {stock['start_tables']} {ours['start_tables']}")
    diffs = [abs(a - b) for a, b in zip(stock["losses"], ours["losses"])]
    first_differ = next((i for i, d in enumerate(diffs) if d > 0), None)
    first_over = next((i for i, d in enumerate(diffs) if d > tolerance), None)
    return {
        "tables": tables,
        "workload": WORKLOADS[tables][0] + (f", capped at {cap:,} rows" if (cap := WORKLOADS[tables][1]) else ""),
        "nproc": nproc,
        "steps": steps,
        "batch_size_per_rank": batch_size,
        "eval_batches_per_rank": eval_batches,
        "tpurec_path": "layout" if layout else "direct",
        "tolerance": tolerance,
        "max_loss_difference": max(diffs),
        "first_step_differing": first_differ,
        "first_step_over_tolerance": first_over,
        "losses_within_tolerance": first_over is None,
        "auc": {"torchrec": stock["auc"], "tpurec": ours["auc"]},
        "auc_equal_to_3_decimals": round(stock["auc"], 3) == round(ours["auc"], 3),
        "final_loss": {"torchrec": stock["losses"][-1], "tpurec": ours["losses"][-1]},
        "losses": {"torchrec": stock["losses"], "tpurec": ours["losses"]},
        "inputs_checked": stock["inputs"],
        "start_tables_checked": stock["start_tables"],
        "load_average": {"start": load_start, "end": rounds.load_average()},
    }


def format_text(r: dict) -> str:
    first = r["first_step_differing"]
    over = r["first_step_over_tolerance"]
    return "\n".join(
        [
            f"{r['workload']}; {r['nproc']} rank(s), batch {r['batch_size_per_rank']}/rank, {r['steps']} steps; "
            f"tpurec on the {r['tpurec_path']} path",
            f"per-step loss: largest difference {r['max_loss_difference']:.3g}; "
            + ("equal at every step" if first is None else f"first differs at step {first}")
            + ("" if over is None else f", beyond {r['tolerance']:g} at step {over}"),
            f"AUC over {r['eval_batches_per_rank']} held-out batches/rank: stock TorchRec {r['auc']['torchrec']:.5f}, "
            f"tpurec {r['auc']['tpurec']:.5f} "
            f"({'equal' if r['auc_equal_to_3_decimals'] else 'NOT equal'} to 3 decimals)",
            f"final loss: stock {r['final_loss']['torchrec']:.6f}, tpurec {r['final_loss']['tpurec']:.6f}; "
            f"load average {r['load_average']['start'][0]} at start, {r['load_average']['end'][0]} at end",
        ]
    )


def worker(side: str, tables: str, data: str, steps: int, batch_size: int, eval_batches: int) -> dict | None:
    import torch
    import torch.distributed as dist

    from tpurec.dlrm import metrics

    dmp, pipeline, batches, inputs, start, schedule = prepare_side(
        side, WORKLOADS[tables], data, batch_size, steps + eval_batches
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held_out = batches[:steps], batches[steps:]
    losses = []
    it = iter(train)
    for t in range(steps):  # the pipeline drains its in-flight batches once the list runs out
        schedule.set_step(t)  # the config's learning-rate schedule (warm-up), as `tpurec train` runs it
        losses.append(float(pipeline.progress(it)[0]))
    dmp.eval()
    logits, labels = [], []
    with torch.no_grad():  # the drained pipeline forwards only in eval mode (as tpurec train evaluates)
        eval_it = iter(held_out)
        while True:
            try:
                _, lo, la = pipeline.progress(eval_it)
            except StopIteration:
                break
            logits.append(lo)
            labels.append(la)
    figures = metrics.compute(*metrics.gather(torch.cat(logits), torch.cat(labels)))
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    out = {
        "side": side,
        "losses": [float(v) for v in mean_losses],
        "auc": float(figures["auc"]),
        "eval_rows": int(figures["rows"]),
        "inputs": inputs,
        "start_tables": start,
    }
    dist.destroy_process_group()
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.track", description="one rank of tpurec bench track")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--tables", choices=tuple(WORKLOADS), default="kaggle-100k")
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--layout", action="store_true")
    a = p.parse_args(argv)
    if a.layout:
        os.environ["TPUREC_NO_DIRECT"] = "1"
    out = worker(a.side, a.tables, a.data, a.steps, a.batch_size, a.eval_batches)
    if out is not None:
        print(strict_json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from tpurec.runtime.rank_exit import run_and_exit

    run_and_exit(main)  # not through the interpreter's teardown: gloo can abort it (rank_exit.py)
