"""`tpurec launch`: run your own program on every rank of a TPU slice, real or emulated.

    tpurec launch --emulate-tpu v5p-16 examples/sequential_recommender.py --steps 50
    tpurec launch --device tpu --nproc 4 my_training.py          # one TPU VM
    tpurec launch --device tpu --nnodes 2 my_training.py         # every host of a 2-host slice

What `tpurec train` does for its own ranks (`tpurec.dlrm.slice_launch`): TorchTPU's launch
environment decided first, one torch.distributed.run agent per host. In an emulated rank,
`import tpurec` installs TorchTPU's stand-ins (`tpurec.emulation`), so the program's
`tpurec.DistributedModelParallel(model, device="tpu")` takes the TPU code path on CPU tensors.
"""

from __future__ import annotations

import argparse
import os
import sys

from tpurec.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a program on every rank of a TPU slice (or of an emulated one, on this machine)",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--emulate-tpu", metavar="SLICE", help="emulate SLICE's hosts and ranks here (e.g. v5p-16)")
    where.add_argument("--device", choices=("tpu",), help="this TPU host's devices (with --nnodes: every host)")
    p.add_argument("--nproc", type=int, default=None, help="ranks on this host (--device tpu; default its devices)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts of the slice (--device tpu; run on each; default 1)")
    p.add_argument("program", help="a Python script, or -m MODULE")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments")
    p.set_defaults(run=run)


def _error(msg: str) -> int:
    print(f"tpurec launch: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from tpurec.dlrm import slice_launch

    program = ["-m", *args.args] if args.program == "-m" else [args.program, *args.args]
    if args.program != "-m" and not os.path.isfile(args.program):
        return _error(f"no such program: {args.program}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.emulate_tpu:
        from tpurec.planner.topology import parse_slice

        try:
            spec = parse_slice(args.emulate_tpu)
        except UserError as e:
            raise UserError(f"--emulate-tpu: {e}") from None
        if not spec.generation.sparsecores:
            return _error(f"--emulate-tpu {args.emulate_tpu}: {spec.generation.name} has no SparseCore tpurec drives")
        too_big = slice_launch.emulation_too_big(spec)
        if too_big:
            return _error(f"--emulate-tpu: {too_big}")
        return slice_launch.run_hosts(slice_launch.emulated_agents(spec.name, env, program))
    if args.nnodes < 1 or (args.nproc is not None and args.nproc < 1):
        return _error("--nproc and --nnodes must be >= 1")
    agent = slice_launch.tpu_agent(args.nproc, args.nnodes, env, program)  # UserError when TorchTPU refuses
    return slice_launch.run_hosts([agent])
