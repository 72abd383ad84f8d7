"""`tpurec train`: train DLRM / DLRM-DCNv2 on Criteo-style Parquet data (or a cached synthetic set).

Only argparse at module top (so `tpurec --help` stays instant). With --nproc N > 1 this process only
launches N ranks of `python -m tpurec.dlrm.train` through torch.distributed.run and returns its exit
code; torch.distributed.run stops every rank when one fails and names it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

_MODELS = ("dlrm-tiny", "criteo-kaggle", "mlperf-dcnv2")  # tpurec/dlrm/configs.py (not imported: speed)

_EPILOG = """\
examples:
  tpurec train                                   # dlrm-tiny on cached synthetic data, ~1 min on 2 cores
  tpurec train --nproc 2 --metrics-out run/metrics.csv
  tpurec train --data /data/criteo-parquet --model criteo-kaggle --epochs 1 --checkpoint-dir ckpt
  tpurec train --checkpoint-dir ckpt --resume    # continue from the newest complete checkpoint
  torchrun --nnodes 2 --nproc-per-node 4 ... -m tpurec.dlrm.train --data DIR   # multi-host

stdout gets one JSON line with the final figures; everything else goes to stderr.
"""


def register(sub) -> None:
    p = sub.add_parser("train", help="train DLRM / DLRM-DCNv2 (tpurec DMP, planner, Parquet reader)",
                       description="Train DLRM or DLRM-DCNv2 with tpurec.DistributedModelParallel and "
                                   "TorchRec's TrainPipelineSparseDist, evaluating AUC / NE / log loss.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks to launch through torch.distributed.run (default 1: this process)")
    p.set_defaults(run=run)


def add_arguments(p) -> None:
    p.add_argument("--data", metavar="DIR", help="Parquet dataset (tpurec data convert/synth); default: "
                   "synthetic data for the model's tables, generated once into ~/.cache/tpurec")
    p.add_argument("--model", choices=_MODELS, default="dlrm-tiny", help="named config (default dlrm-tiny)")
    p.add_argument("--interaction", choices=("dot", "dcn"),
                   help="dot (DLRM) or dcn (DLRM-DCNv2 cross layers); default: the model's")
    p.add_argument("--device", choices=("auto", "cpu", "tpu"), default="auto",
                   help="auto: TPU when this host has a usable one, else CPU")
    p.add_argument("--batch-size", type=int, help="batch size per rank (config default)")
    p.add_argument("--steps", type=int, help="training steps (overrides --epochs)")
    p.add_argument("--epochs", type=float, help="passes over the training split (config default 1)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval-fraction", type=float, help="held-out share of the data (config default 0.05)")
    p.add_argument("--embedding-lr", type=float, help="learning rate of the fused table optimiser")
    p.add_argument("--dense-lr", type=float, help="learning rate of the dense (MLP) optimiser")
    p.add_argument("--synth-rows", type=int, help="rows of the default synthetic dataset")
    p.add_argument("--seed", type=int, help="seed for init, shuffling and synthetic data (default 0)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here (periodic and final)")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: --eval-every)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (0: all; default 2)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, or from PATH")
    p.add_argument("--plan", metavar="PLAN.json", help="use a saved sharding plan instead of planning")
    p.add_argument("--save-plan", metavar="PLAN.json", help="save the plan used (for --plan later)")
    p.add_argument("--metrics-out", metavar="FILE", help="metrics as .csv or .jsonl; curves as FILE.png beside it")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: 1 with several ranks)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _check(args) -> str | None:
    """A one-line message for bad input, checked before anything heavy starts."""
    if args.data and not os.path.isdir(args.data):
        return f"--data {args.data}: not a directory"
    if args.plan and not os.path.isfile(args.plan):
        return f"--plan {args.plan}: file not found"
    if args.metrics_out and not args.metrics_out.lower().endswith((".csv", ".jsonl", ".json")):
        return "--metrics-out must end in .csv or .jsonl"
    if args.resume and args.resume == "latest" and not args.checkpoint_dir:
        return "--resume needs --checkpoint-dir (or --resume PATH)"
    for name in ("batch_size", "steps", "checkpoint_every", "synth_rows"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if getattr(args, "nproc", 1) < 1:
        return "--nproc must be >= 1"
    if args.device == "tpu":
        from tpurec.device import tpu_status

        missing = tpu_status().missing()
        if missing:
            return f"--device tpu: this host cannot run TPU kernels ({'; '.join(missing)}); see `tpurec env`"
    return None


def _error(msg: str) -> int:
    print(f"tpurec train: error: {msg}", file=sys.stderr)
    return 2


def to_argv(args, parser) -> list[str]:
    """The worker's command line for the options given (everything but --nproc)."""
    out = []
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "nproc"):
            continue
        v = getattr(args, a.dest, None)
        if v is None or v is False or v == a.default:
            continue
        out += [a.option_strings[0]] if v is True else [a.option_strings[0], str(v)]
    return out


def run(args) -> int:
    msg = _check(args)
    if msg:
        return _error(msg)
    if args.nproc == 1 or "RANK" in os.environ:
        return run_worker(args)
    # Make the default dataset here, once, before the ranks start (they then find it cached).
    if not args.data:
        try:
            _prepare_synth(args)
        except ValueError as e:
            return _error(str(e))
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "tpurec.dlrm.train", *to_argv(args, p)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)


def _prepare_synth(args) -> None:
    from tpurec.dlrm.configs import get_config, override
    from tpurec.dlrm.data import ensure_synth

    cfg = override(get_config(args.model), seed=args.seed, synth_rows=args.synth_rows)
    ensure_synth(cfg.table_set, cfg.synth_rows, cfg.seed, say=lambda m: print(m, file=sys.stderr))


def run_worker(args) -> int:
    """One rank: user errors print one line naming the rank and exit 2; other failures re-raise
    after a line naming the rank, so torch.distributed.run reports them and stops the job."""
    msg = _check(args)
    if msg:
        return _error(msg)
    from tpurec.data import DataError
    from tpurec.device import TpuUnavailableError
    from tpurec.dlrm.train import run_training

    rank = os.environ.get("RANK", "0")
    try:
        return run_training(args)
    except (DataError, TpuUnavailableError, FileNotFoundError, ValueError) as e:
        print(f"tpurec train: error: rank {rank}: {e}", file=sys.stderr)
        return 2
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            print(f"tpurec train: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
