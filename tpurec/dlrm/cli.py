"""`tpurec train`: train DLRM / DLRM-DCNv2 on Criteo-style Parquet data (or a cached synthetic set).

Light at module top (argparse and the options dataclass, so `tpurec --help` stays instant). The flags
are the fields of `tpurec.dlrm.options.TrainOptions` plus `--nproc`. With --nproc N > 1 this process
only launches N ranks of `python -m tpurec.dlrm` through torch.distributed.run, handing them the
parsed options as JSON (TPUREC_TRAIN_OPTIONS), and returns its exit code; torch.distributed.run
stops every rank when one fails and names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import TYPE_CHECKING

from tpurec.dlrm.options import OPTIONS_ENV, TrainOptions
from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from tpurec.dlrm.trainer import Trainer

RANK_PROGRAM = ("-m", "tpurec.dlrm")  # what each launched rank runs: one rank of `tpurec train`

_EPILOG = """\
examples:
  tpurec train                                   # dlrm-tiny on cached synthetic data, ~1 min on 2 cores
  tpurec train --nproc 2 --metrics-out run/metrics.csv
  tpurec train --data /data/criteo-parquet --model criteo-kaggle --epochs 1 --checkpoint-dir ckpt
  tpurec train --checkpoint-dir ckpt --resume    # continue from the newest complete checkpoint
  tpurec train --data RAW --zch --zch-eviction lfu   # managed-collision tables on raw ids (data synth --raw-ids)
  tpurec train --emulate-tpu v5p-16              # a 2-host TPU slice's 8 ranks, on this machine's CPU
  tpurec train --device tpu --nproc 4            # one TPU VM (TorchTPU's launch environment set first)
  tpurec train --device tpu --nnodes 2 --data DIR   # multi-host: the same command on every host

stdout gets one JSON line with the final figures; everything else goes to stderr.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train DLRM / DLRM-DCNv2, or your own TorchRec model (--model-module), on tpurec's DMP, planner "
        "and Parquet reader",
        description="Train DLRM or DLRM-DCNv2, or your own TorchRec model (--model-module MOD:FN, "
        "docs/your_model.md), with tpurec.DistributedModelParallel and TorchRec's TrainPipelineSparseDist, "
        "evaluating AUC / NE / log loss.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    TrainOptions.add_arguments(p)
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to launch through torch.distributed.run (default 1: this process; with "
        "--device tpu --nnodes: the host's TPU devices)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="hosts of a TPU slice (--device tpu): run the same command on every host; this host's rank "
        "is the TPU VM's worker id (TPU_WORKER_ID or its metadata server), the hosts TPU_WORKER_HOSTNAMES "
        "or the metadata's worker list, handed to TorchTPU's set_tpu_launch_env() (default 1)",
    )
    p.add_argument(
        "--emulate-tpu",
        metavar="SLICE",
        default=None,
        help="run every rank of a TPU slice (e.g. v5p-16: 2 hosts x 4 ranks) on this machine's CPU, on "
        "tpurec's TPU code path with TorchTPU's rules emulated (docs/tpu.md)",
    )
    p.set_defaults(run=run)


def _error(msg: str) -> int:
    print(f"tpurec train: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    options = TrainOptions.from_args(args)
    msg = _launch_problem(args, options)
    if args.emulate_tpu:
        # The ranks run the TPU code path; this launcher checks the rest as for a CPU run.
        msg = msg or dataclasses.replace(options, device="cpu").check(nproc=args.nproc or 1, tpu_ranks=True)
        options = dataclasses.replace(options, device="tpu")
    else:
        msg = msg or options.check(nproc=args.nproc or 1)
    if msg:
        return _error(msg)
    if "RANK" in os.environ or (args.nproc in (None, 1) and args.nnodes == 1 and not args.emulate_tpu):
        if options.device == DeviceKind.TPU and "RANK" not in os.environ:
            from tpurec.runtime.device import tpu_status
            from tpurec.runtime.local_group import sockets_refused

            # One process asks TorchTPU for its launch environment (ports for a slice builder); a host
            # that refuses sockets cannot give ports, and one process runs without them (on the v5e
            # chip, docs/tpu.md): its group is then tpurec's local one (runtime/local_group.py).
            if tpu_status().usable and not sockets_refused():
                from tpurec.launch.hosts import torchtpu_launch_env

                launch = torchtpu_launch_env(1, 1)  # UserError when TorchTPU refuses this host
                os.environ.update({k: v for k, v in launch.items() if k not in os.environ})
        if options.model_module and "RANK" not in os.environ and _on_tpu(options):
            # one process on a TPU: its forward's missing ops are one line here, not TorchTPU's traceback
            msg = _files_problem(args, options)
            if msg:
                return _error(msg)
        return run_worker(options)
    # Make the default dataset here, once, before the ranks start (they then find it cached).
    if not options.data:
        _prepare_synth(options)
    msg = _files_problem(args, options)
    if msg:
        return _error(msg)
    from tpurec.launch import hosts

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{OPTIONS_ENV: options.to_json()})
    if args.emulate_tpu:
        agents = hosts.emulated_agents(args.emulate_tpu, env, RANK_PROGRAM)
    elif options.device == DeviceKind.TPU:
        agents = [hosts.tpu_agent(args.nproc, args.nnodes, env, RANK_PROGRAM)]
    else:
        agents = [(hosts.agent_command(args.nproc, RANK_PROGRAM), env)]
    # SIGTERM / Ctrl-C of this launcher reach each torch.distributed.run, which stops its ranks; if
    # this process is killed outright, the kernel sends them SIGTERM (they die with their parent).
    return hosts.run_hosts(agents, "tpurec train")


def _launch_problem(args: argparse.Namespace, options: TrainOptions) -> str | None:
    if args.nnodes < 1:
        return "--nnodes must be >= 1"
    if args.nnodes > 1 and options.device != DeviceKind.TPU:
        return "--nnodes is for a multi-host TPU slice (--device tpu); on CPU hosts use torchrun on each host"
    if args.emulate_tpu:
        from tpurec.planner.topology import parse_slice

        try:
            spec = parse_slice(args.emulate_tpu)
        except UserError as e:
            return f"--emulate-tpu: {e}"
        from tpurec.launch.hosts import emulation_too_big

        too_big = emulation_too_big(spec)
        if too_big:
            return f"--emulate-tpu: {too_big}"
        if args.nproc not in (None, spec.devices_per_host) or args.nnodes != 1:
            return (
                f"--emulate-tpu {spec.name} runs {spec.hosts} host(s) x {spec.devices_per_host} ranks; "
                "leave --nproc and --nnodes unset"
            )
        if options.device not in ("auto", DeviceKind.TPU):
            return f"--emulate-tpu runs the TPU code path; --device {options.device} contradicts it"
    if args.emulate_tpu or options.device == DeviceKind.TPU:
        from tpurec.sharding import tpu_all_to_all

        try:
            tpu_all_to_all.check(None, DeviceKind.TPU)  # TPUREC_TPU_ALL_TO_ALL=uneven: refused before any rank starts
        except UserError as e:
            return str(e)
    return None


def _files_problem(args: argparse.Namespace, options: TrainOptions) -> str | None:
    """A --model-module against --data, and --plan and --limits against the model, world size and
    slice, once, before any rank starts (tpurec/dlrm/preflight.py); a real TPU slice's world is known
    only to its ranks."""
    if not (options.plan or options.id_limits or options.model_module):
        return None
    world: int | None = None
    slice_name = None
    if args.emulate_tpu:
        from tpurec.planner.topology import parse_slice

        world, slice_name = parse_slice(args.emulate_tpu).world_size, args.emulate_tpu
    elif options.device != DeviceKind.TPU:
        world = args.nproc or 1
    from tpurec.dlrm.preflight import check_before_launch

    try:
        check_before_launch(options, world, slice_name, tpu=_on_tpu(options))
    except UserError as e:
        return str(e)
    return None


def _on_tpu(options: TrainOptions) -> bool:
    """Whether the ranks run on a TPU (an emulated slice's ranks have device 'tpu' here)."""
    if options.device == "auto":
        from tpurec.runtime.device import tpu_status

        return tpu_status().usable
    return options.device == "tpu"


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
    """One rank: user errors (UserError, OSError) print one line naming the rank and exit 2; other
    failures re-raise after a line naming the rank, so torch.distributed.run reports them and stops
    the job. Ctrl-C:
    one line saying which checkpoint is the last complete one, exit 130. A non-daemon thread the
    model started and left running does not keep the process alive: one warning names it."""
    import threading

    from tpurec.runtime import rank_exit

    before = set(threading.enumerate())
    code = _run_worker(options)
    rank_exit.end_despite_threads("tpurec train", code, before)
    return code


def _run_worker(options: TrainOptions) -> int:
    from tpurec.runtime import interrupts, terminate

    # SIGTERM before the training loop (building the model, opening the data, planning) unwinds as
    # Terminated: one line, exit 143; from the loop on the trainer records it (stop_request.py).
    with interrupts.handled(), terminate.unwinding_on_sigterm():
        trainer = None
        try:
            msg = options.check()
            if msg:  # every rank finds it: printed once (tpurec/runtime/rank_errors.py)
                return _rank_error(msg)
            from tpurec.dlrm.trainer import Trainer

            trainer = Trainer(options)
            return _run_rank(trainer)
        except KeyboardInterrupt:
            _report_stop(options, trainer, "interrupted")
            return interrupts.EXIT_INTERRUPTED
        except terminate.Terminated:
            _report_stop(options, trainer, "stopped by SIGTERM")
            return terminate.EXIT_TERMINATED


def _report_stop(options: TrainOptions, trainer: Trainer | None, what: str) -> None:
    """What a signal left, one line: once for the ranks of a launched job (rank_errors), else here."""
    from tpurec.runtime import group_watch, rank_errors

    if os.environ.get(group_watch.WATCH_ENV) and "RANK" in os.environ:
        rank_errors.report("tpurec train", interrupted(options, trainer, rank_named=False, what=what))
    else:
        print(f"tpurec train: {interrupted(options, trainer, what=what)}", file=sys.stderr)


def _rank_error(message: str) -> int:
    """A user error this rank found: one line naming the rank, once for all ranks that find it."""
    from tpurec.runtime import rank_errors

    rank_errors.report("tpurec train: error", message)
    return 2


def interrupted(
    options: TrainOptions, trainer: Trainer | None, rank_named: bool = True, what: str = "interrupted"
) -> str:
    """What a Ctrl-C (or a SIGTERM before the training loop) left: the step reached and the last
    complete checkpoint (`rank_named`: with ` (rank R)` after the step; a launcher names the ranks
    itself, `tpurec.runtime.rank_errors`)."""
    at = f" at step {trainer.step_count}" if trainer is not None and trainer.step_count else ""
    if rank_named:
        at += f" (rank {os.environ.get('RANK', '0')})"
    if not options.checkpoint_dir:
        return f"{what}{at}; nothing saved (no --checkpoint-dir)"
    from tpurec.dlrm.ckpt.manager import CheckpointManager

    last = CheckpointManager(options.checkpoint_dir).latest()  # a reader only: no lock taken
    if last is None:
        return f"{what}{at}; no complete checkpoint in {options.checkpoint_dir}"
    return f"{what}{at}; the last complete checkpoint is step {int(last.name[5:])} ({last})"


def _run_rank(trainer: Trainer) -> int:
    from tpurec.runtime import heartbeat, interrupts
    from tpurec.runtime.stop_request import StoppedBySignal

    rank, options = os.environ.get("RANK", "0"), trainer.options
    try:
        trainer.run()
        return 0
    except (UserError, OSError) as e:  # the user's input or environment (tpurec/errors.py)
        interrupts.check()  # DCP wraps a Ctrl-C in its save into an error of its own
        return _rank_error(str(e))
    except RuntimeError as e:
        interrupts.check()  # a peer that Ctrl-C stopped broke this rank's collective
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
    except StoppedBySignal as e:  # SIGTERM / Ctrl-C: stopped at an agreed step, saved (stop_request.py)
        if rank == "0":  # every rank stopped alike: one line
            print(f"tpurec train: {e}", file=sys.stderr)
        return int(e.code or 1)
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):  # SystemExit: terminate.Terminated's own line
            print(f"tpurec train: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    finally:
        heartbeat.stop(done=True)  # this rank is finished (or failed and said so): not silent
