"""Launching a program's ranks (`tpurec launch`, `tpurec train`) on a TPU slice: real (one host, or this
host of several) or emulated.

TorchTPU 0.2.0 needs its launch environment decided in the parent before any rank starts
(`torch.tpu.distributed.set_tpu_launch_env()`, `torch_tpu/_internal/distributed/distributed.py`):
without it a distributed run stops with "missing required environment variables for distributed
training". So every TPU launch here gets it first, then starts one torch.distributed.run agent per
host, with `LOCAL_WORLD_SIZE` = ranks on that host:

* `--device tpu --nproc N` (one host): TorchTPU's own function, run in a child process so that this
  launcher never loads torch_tpu (`torchtpu_launch_env`);
* `--device tpu --nnodes H` on every host of a slice: the same function, given this host's index
  (`JOB_COMPLETION_INDEX`) and the slice's hosts (`TPU_WORKER_HOSTNAMES`), which TorchTPU needs and a
  Cloud TPU VM keeps in its metadata server (`cloud_tpu_host_env`); it derives `NODE_RANK`,
  `MASTER_ADDR` and `MASTER_PORT` from them;
* `--emulate-tpu SLICE`: the slice's hosts on this machine, each given what a TPU VM gives it (the same
  `cloud_tpu_host_env`) and TorchTPU's rules applied (`tpurec.emulation.launch_env`), every rank on the
  TPU code path.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from tpurec.errors import UserError
from tpurec.runtime import safe_path
from tpurec.runtime.tpu_vm import cloud_tpu_host_env

if TYPE_CHECKING:
    from types import FrameType

    from tpurec.planner.topology import SliceSpec

# What set_tpu_launch_env() may set (it reads TORCH_TPU_DEVICES_PER_HOST, never sets it); all of it is
# handed to the ranks.
TORCHTPU_LAUNCH_VARS = (
    "TORCH_TPU_SLICEBUILDER_ADDRESSES",
    "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_XPROF_SESSION_ID",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_MARK = "TPUREC_LAUNCH_ENV="
COMMAND_ENV = "TPUREC_LAUNCH_COMMAND"  # the command that started the agents, named in their line on failed ranks


def torchtpu_launch_env(nnodes: int, nproc_per_node: int | None) -> dict[str, str]:
    """TorchTPU's launch environment for this host, from its own `set_tpu_launch_env()` in a child
    (importing torch_tpu in the launcher would be wasted, and the child exits before ranks start), given
    what this TPU VM says about its place in the slice (`cloud_tpu_host_env`)."""
    given = cloud_tpu_host_env(nnodes, os.environ)
    code = (
        "import json, os, torch\n"
        "from torch.tpu import distributed\n"
        f"distributed.set_tpu_launch_env(nnodes={nnodes}, nproc_per_node={nproc_per_node!r})\n"
        f"keys = {TORCHTPU_LAUNCH_VARS!r}\n"
        f"print({_MARK!r} + json.dumps({{k: os.environ[k] for k in keys if k in os.environ}}))\n"
    )
    env = dict(
        os.environ,
        **given,
        TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=os.environ.get("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "1"),
    )
    done = subprocess.run(
        safe_path.python("-c", code), env=safe_path.env(env), capture_output=True, text=True, timeout=600
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith(_MARK)]
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"TorchTPU's set_tpu_launch_env() failed on this host: {last}")
    return dict(given, **json.loads(lines[-1][len(_MARK) :]))


def agent_command(
    nproc_per_node: int,
    program: tuple[str, ...] | list[str],
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
) -> list[str]:
    """torch.distributed.run (failures reported in one line, `tpurec.launch.agent`) for one host,
    running `program` (`-m MODULE ...` or `SCRIPT ...`) in every rank. The agent and its ranks start
    without the working directory on sys.path; a SCRIPT gets its own directory, as `python SCRIPT`
    gives it (`tpurec.runtime.safe_path`)."""
    if program[0] != "-m":
        program = safe_path.script(*program)
    cmd = safe_path.python("-m", "tpurec.launch.agent")
    if nnodes == 1 and master is None:
        cmd.append("--standalone")
    else:
        addr, port = (master or "127.0.0.1:29500").rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={addr}", f"--master-port={port}"]
    # A rank that cannot act on SIGTERM (stopped, hung in the kernel) is SIGKILLed after 5 s,
    # not torch.distributed.run's 30.
    return cmd + [f"--nproc-per-node={nproc_per_node}", "--shutdown-timeout=5", *program]


def run_hosts(
    agents: list[tuple[list[str], dict[str, str]]],
    command: str = "tpurec launch",
    say_stopped: bool = False,
    timeout: float | None = None,
    report: tuple[int, str | None] | None = None,
) -> int:
    """Run one agent per (command, environment) together; when one fails the others are stopped.
    Exit code: the first failure's (2 if any agent reported bad input), else 0.

    The ranks' one-line errors are printed once each when the agents have ended, with the ranks that
    raised them (`tpurec.runtime.rank_errors`). `say_stopped`: after a SIGINT/SIGTERM/SIGHUP forwarded
    to the agents, one line says so (for programs that do not say it themselves, as `tpurec train`'s
    ranks do). `timeout`: seconds after which every rank is stopped, in one line (exit code 124, as
    timeout(1) gives). `report`: (hosts, emulated slice or None) of a user's program: once every rank
    ended well, one line with the end-of-run checks `tpurec train` reports (tpurec.runtime.run_report).

    A rank of a user's program that exits 0 before the process group forms, while others wait for it
    in init_process_group, would leave them waiting (torch.distributed.run counts it done): the
    ranks record how far they got (`tpurec.runtime.group_watch`) and the run is stopped with one
    line naming it (exit code 1) once that state has lasted `_EARLY_EXIT_GRACE` seconds."""
    import tempfile
    import time

    from tpurec.runtime import group_watch, rank_errors, run_report
    from tpurec.runtime.lifecycle import FORWARDED, die_with_parent

    watch = tempfile.TemporaryDirectory(prefix="tpurec-group-watch-")
    procs = [
        subprocess.Popen(
            cmd,
            env=safe_path.env(env, **{group_watch.WATCH_ENV: watch.name, COMMAND_ENV: command}),
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        for cmd, env in agents
    ]

    signals: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def stop_all() -> None:
        for q in procs:
            if q.poll() is None:
                q.terminate()

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    codes: dict[int, int] = {}
    stuck_since: float | None = None
    stopped: tuple[str, int] | None = None  # the line the run was stopped with, and its exit code
    deadline = None if timeout is None else time.monotonic() + timeout
    announced = False
    try:
        while len(codes) < len(procs):
            for i, p in enumerate(procs):
                if i in codes or p.poll() is None:
                    continue
                codes[i] = p.returncode
                if p.returncode:  # one host failed: the others cannot finish their collectives
                    stop_all()
            left, waiting = group_watch.early_exit(watch.name)
            if left and waiting and stopped is None:
                # the same state a moment later: a rank whose init_process_group just returned has
                # had time to record `formed`
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since >= _EARLY_EXIT_GRACE:
                    stopped = (f"{command}: error: {group_watch.describe(left, waiting)}", 1)
            else:
                stuck_since = None
            if deadline is not None and stopped is None and len(codes) < len(procs) and time.monotonic() >= deadline:
                stopped = (f"{command}: error: the program ran past --timeout {timeout:g} s; stopped every rank", 124)
            if stopped is not None and not announced:
                announced = True  # once: the line, then SIGTERM to the agents
                print(stopped[0], file=sys.stderr, flush=True)
                stop_all()
            if len(codes) < len(procs):
                try:
                    procs[min(set(range(len(procs))) - set(codes))].wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for line in rank_errors.collect(watch.name):
            print(line, file=sys.stderr, flush=True)
        figures = run_report.collect(watch.name)
        watch.cleanup()
    if stopped is not None:
        return stopped[1]
    if signals and say_stopped:
        how = "interrupted" if signals[0] == signal.SIGINT else f"stopped by {signal.Signals(signals[0]).name}"
        print(f"{command}: {how}; every rank of the run was stopped", file=sys.stderr, flush=True)
    failed = [c for c in codes.values() if c]
    if not failed:
        checks = run_report.summary(command, figures, *report) if report else None
        if checks:
            print(checks, file=sys.stderr, flush=True)
        return 0
    code = 2 if 2 in failed else failed[0]
    return 128 - code if code < 0 else code


_EARLY_EXIT_GRACE = 1.0  # seconds a rank that left and a rank waiting are seen together before stopping


def emulation_too_big(spec: SliceSpec) -> str | None:
    """Why this machine cannot hold every rank of `spec` (each a whole Python process with torch and
    TorchRec, ~1 GiB: `tpurec.runtime.host_resources.RANK_OVERHEAD_BYTES`), or None."""
    from tpurec.runtime.host_resources import RANK_OVERHEAD_BYTES, available_bytes

    free = available_bytes()
    need = spec.world_size * RANK_OVERHEAD_BYTES
    if free is None or need <= free:
        return None
    fits = max(0, free // RANK_OVERHEAD_BYTES)
    return (
        f"{spec.name} has {spec.world_size} ranks, ~{need / 2**30:.0f} GiB as processes on this machine, which has "
        f"{free / 2**30:.1f} GiB available (room for about {fits} ranks); emulate a smaller slice of the same "
        "generation (the rules do not depend on the slice's size past 2 hosts)"
    )


def emulated_agents(
    slice_name: str, base_env: dict[str, str], program: tuple[str, ...] | list[str]
) -> list[tuple[list[str], dict[str, str]]]:
    """One agent per host of the emulated slice, each with its launch environment."""
    from tpurec.emulation.launch_env import emulated_launch_env
    from tpurec.planner.topology import parse_slice
    from tpurec.runtime.device import EMULATE_ENV

    spec = parse_slice(slice_name)
    agents = []
    for host, launch in enumerate(emulated_launch_env(spec)):
        # A Cloud TPU VM names its slice in TPU_ACCELERATOR_TYPE; tpurec plans for it when given none.
        env = dict(base_env, **launch, **{EMULATE_ENV: spec.name, "TPU_ACCELERATOR_TYPE": spec.name})
        master = f"{launch['MASTER_ADDR']}:{launch['MASTER_PORT']}" if spec.hosts > 1 else None
        agents.append((agent_command(spec.devices_per_host, program, spec.hosts, host, master), env))
    return agents


def tpu_agent(
    nproc: int | None, nnodes: int, base_env: dict[str, str], program: tuple[str, ...] | list[str]
) -> tuple[list[str], dict[str, str]]:
    """This host's agent of a real TPU launch, with TorchTPU's launch environment."""
    launch = torchtpu_launch_env(nnodes, nproc)
    addresses = launch["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    per_host = nproc or len(addresses) // nnodes  # TorchTPU gives every host the same number of addresses
    env = dict(base_env, **launch)
    if nnodes == 1:
        return agent_command(per_host, program), env
    master = f"{launch['MASTER_ADDR']}:{launch['MASTER_PORT']}"
    return agent_command(per_host, program, nnodes, int(launch["NODE_RANK"]), master), env
