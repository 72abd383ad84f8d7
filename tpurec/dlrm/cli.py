"""`tpurec train`: train DLRM / DLRM-DCNv2 on Criteo-style Parquet data (or a cached synthetic set).

Light at module top (argparse and the options dataclass, so `tpurec --help` stays instant). The flags
are the fields of `tpurec.dlrm.options.TrainOptions` plus `--nproc`. With --nproc N > 1 this process
only launches N ranks of `python -m tpurec.dlrm` through torch.distributed.run, handing them the
parsed options as JSON (TPUREC_TRAIN_OPTIONS), and returns its exit code; torch.distributed.run
stops every rank when one fails and names it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from tpurec.dlrm.options import OPTIONS_ENV, TrainOptions

_EPILOG = """\
examples:
  tpurec train                                   # dlrm-tiny on cached synthetic data, ~1 min on 2 cores
  tpurec train --nproc 2 --metrics-out run/metrics.csv
  tpurec train --data /data/criteo-parquet --model criteo-kaggle --epochs 1 --checkpoint-dir ckpt
  tpurec train --checkpoint-dir ckpt --resume    # continue from the newest complete checkpoint
  torchrun --nnodes 2 --nproc-per-node 4 ... -m tpurec.dlrm --data DIR   # multi-host

stdout gets one JSON line with the final figures; everything else goes to stderr.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train DLRM / DLRM-DCNv2 (tpurec DMP, planner, Parquet reader)",
        description="Train DLRM or DLRM-DCNv2 with tpurec.DistributedModelParallel and "
        "TorchRec's TrainPipelineSparseDist, evaluating AUC / NE / log loss.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    TrainOptions.add_arguments(p)
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local ranks to launch through torch.distributed.run (default 1: this process)",
    )
    p.set_defaults(run=run)


def _error(msg: str) -> int:
    print(f"tpurec train: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    options = TrainOptions.from_args(args)
    msg = options.check(nproc=args.nproc)
    if msg:
        return _error(msg)
    if args.nproc == 1 or "RANK" in os.environ:
        return run_worker(options)
    # Make the default dataset here, once, before the ranks start (they then find it cached).
    if not options.data:
        try:
            _prepare_synth(options)
        except ValueError as e:
            return _error(str(e))
    cmd = [
        sys.executable,
        "-m",
        "tpurec.dlrm.launch",  # torch.distributed.run, its failure reported in one line
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        # A rank that cannot act on SIGTERM (stopped, hung in the kernel) is SIGKILLed after 5 s,
        # not torch.distributed.run's 30.
        "--shutdown-timeout=5",
        "-m",
        "tpurec.dlrm",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{OPTIONS_ENV: options.to_json()})
    from tpurec.lifecycle import run_child

    # SIGTERM / Ctrl-C of this launcher reach torch.distributed.run, which stops every rank; if this
    # process is killed outright, the kernel sends the launcher SIGTERM (it dies with its parent).
    return run_child(cmd, env=env)


def _prepare_synth(options: TrainOptions) -> None:
    from tpurec.dlrm.configs import get_config, override, synth_multi_hot
    from tpurec.dlrm.data import ensure_synth

    # Only what names the dataset: the ranks check the other overrides (and report them per rank).
    cfg = override(
        get_config(options.model),
        seed=options.seed,
        synth_rows=options.synth_rows,
        multi_hot_sizes=options.multi_hot_sizes,
    )
    ensure_synth(
        cfg.table_set,
        cfg.synth_rows,
        cfg.seed,
        say=lambda m: print(m, file=sys.stderr),
        multi_hot=synth_multi_hot(cfg),
    )


def run_worker(options: TrainOptions) -> int:
    """One rank: user errors print one line naming the rank and exit 2; other failures re-raise
    after a line naming the rank, so torch.distributed.run reports them and stops the job."""
    msg = options.check()
    if msg:
        return _error(msg)
    from tpurec import heartbeat
    from tpurec.data.schema import DataError
    from tpurec.device import TpuUnavailableError
    from tpurec.dlrm.trainer import Trainer

    rank = os.environ.get("RANK", "0")
    try:
        Trainer(options).run()
        return 0
    except (DataError, TpuUnavailableError, FileNotFoundError, ValueError) as e:
        print(f"tpurec train: error: rank {rank}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not heartbeat.lost_peer(e):
            print(f"tpurec train: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
            raise
        # Another rank died (its connection closed) or went silent past --dist-timeout: this rank is
        # not at fault, and its traceback would bury the launcher's line naming the rank that is.
        what = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0] or type(e).__name__  # no gloo source path
        print(
            f"tpurec train: error: rank {rank}: lost another rank in a collective ({what}); "
            f"collectives wait at most --dist-timeout {options.dist_timeout:g} s",
            file=sys.stderr,
        )
        return heartbeat.EXIT_PEER_SILENT
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            print(f"tpurec train: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    finally:
        heartbeat.stop(done=True)  # this rank is finished (or failed and said so): not silent
