"""`tpurec launch`: run your own program on every rank of a TPU slice, real or emulated.

    tpurec launch --emulate-tpu v5p-16 examples/sequential_recommender.py --steps 50
    tpurec launch --device tpu --nproc 4 my_training.py          # one TPU VM
    tpurec launch --device tpu --nnodes 2 my_training.py         # every host of a 2-host slice
    tpurec launch --emulate-tpu v5p-8 -- -m mypackage.train      # a module (PYTHONPATH, installed)
    tpurec launch --emulate-tpu v5p-8 --timeout 600 my_test.py   # every rank stopped after 10 minutes

What `tpurec train` does for its own ranks (`tpurec.launch.hosts`): TorchTPU's launch
environment decided first, one torch.distributed.run agent per host. In an emulated rank,
`import tpurec` installs TorchTPU's stand-ins (`tpurec.emulation`), so the program's
`tpurec.DistributedModelParallel(model, device="tpu")` takes the TPU code path on CPU tensors.
The program's own directory is first on sys.path, as under `python my_training.py`; no rank has the
working directory there (`PYTHONPATH=.` puts it there on purpose). An error every rank finds is printed
once, naming the ranks; a killed rank, a Ctrl-C or --timeout stop every rank in one line.
"""

from __future__ import annotations

import argparse
import os
import sys

from tpurec.argtypes import positive_float
from tpurec.errors import UserError
from tpurec.runtime import safe_path
from tpurec.runtime.device import DeviceKind


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
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="stop every rank after SECONDS, in one line (exit 124); default: no bound",
    )
    p.add_argument("program", help="a Python script, or -m MODULE (after --: `tpurec launch ... -- -m MODULE`)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments")
    p.set_defaults(run=run)


def _error(msg: str) -> int:
    print(f"tpurec launch: error: {msg}", file=sys.stderr)
    return 2


def _module_problem(name: str) -> str | None:
    """Why the ranks would not find module `name`, or None. They start without the working directory
    on sys.path (`tpurec.runtime.safe_path`), so a module found only there is refused, naming the fix."""
    import importlib.util

    top = name.partition(".")[0]
    spec = importlib.util.find_spec(top) if top else None  # a top-level name: finding it runs no code
    if spec is not None and spec.origin in ("built-in", "frozen"):
        return None
    places = (list(spec.submodule_search_locations or []) or [spec.origin or ""]) if spec is not None else []
    here = os.path.realpath(os.getcwd())
    if here in {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}:
        return None  # the working directory put on PYTHONPATH on purpose (`PYTHONPATH=.`)
    if any(os.path.dirname(os.path.realpath(p)) != here for p in places if p):
        return None  # found elsewhere than the working directory: the ranks find it too
    return (
        f"-m {name}: no module {top!r} on PYTHONPATH or among the installed packages (the ranks never "
        "import from the working directory; PYTHONPATH=. adds it)"
    )


def run(args: argparse.Namespace) -> int:
    from tpurec.launch import hosts

    program = ["-m", *args.args] if args.program == "-m" else [args.program, *args.args]
    if args.program == "-m":  # through run_script too, which tells the launcher when the group formed
        program = safe_path.script(*program)
    if args.program == "-m":
        problem = _module_problem(args.args[0]) if args.args else "-m needs a module name"
        if problem:
            return _error(problem)
    elif not os.path.isfile(args.program):
        return _error(f"no such program: {args.program}")
    from tpurec.sharding import tpu_all_to_all

    tpu_all_to_all.check(None, DeviceKind.TPU)  # TPUREC_TPU_ALL_TO_ALL=uneven: refused before any rank starts
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.emulate_tpu:
        from tpurec.planner.topology import parse_slice

        try:
            spec = parse_slice(args.emulate_tpu)
        except UserError as e:
            raise UserError(f"--emulate-tpu: {e}") from None
        too_big = hosts.emulation_too_big(spec)
        if too_big:
            return _error(f"--emulate-tpu: {too_big}")
        agents = hosts.emulated_agents(spec.name, env, program)
        report = (spec.hosts, spec.name)
        return hosts.run_hosts(agents, say_stopped=True, timeout=args.timeout, report=report)
    if args.nnodes < 1 or (args.nproc is not None and args.nproc < 1):
        return _error("--nproc and --nnodes must be >= 1")
    agent = hosts.tpu_agent(args.nproc, args.nnodes, env, program)  # UserError when TorchTPU refuses
    return hosts.run_hosts([agent], say_stopped=True, timeout=args.timeout, report=(args.nnodes, None))
