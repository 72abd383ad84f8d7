"""Torch's intra-op thread count per rank, chosen once for programs that build a tpurec DMP.

Torch starts every process with one thread per physical core of the machine, whatever else runs on
it; with several ranks on one host, or cores busy with other work, its threads outnumber the free
cores and every op waits for a busy one (measured in docs/results.md). So
`tpurec.DistributedModelParallel` sets, once per process, the cores this process may run on
(os.sched_getaffinity) that were idle over the last 0.2 s (/proc/stat), divided among the ranks on
this host (LOCAL_WORLD_SIZE, set by torchrun), at least 1, unless the user chose:

* `threads=N` passed to `tpurec.DistributedModelParallel`, or TPUREC_THREADS=N: that count;
* OMP_NUM_THREADS or MKL_NUM_THREADS set: torch already read it at start, left alone;
* torch.set_num_threads called before the DMP: a count other than torch's start-up one, left alone.

torchrun with several ranks and `tpurec launch` set OMP_NUM_THREADS=1 for their ranks themselves;
`tpurec train` pins its ranks (`--threads`, default 1).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Mapping, Tuple

from tpurec.errors import UserError

logger = logging.getLogger(__name__)

THREADS_ENV = "TPUREC_THREADS"
# Variables torch reads at start for its intra-op count (ATen/ParallelCommon.cpp, intraop_default_num_threads).
TORCH_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_applied = False


def physical_cores() -> int:
    """Physical cores of the machine: torch's start-up thread count when no variable sets it
    (c10/core/thread_pool.cpp, TaskThreadPoolBase::defaultNumThreads: cpuinfo's core count)."""
    cores = set()
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(os.path.join(path, "physical_package_id")) as f, open(os.path.join(path, "core_id")) as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def idle_cores(cpus: set[int], seconds: float = 0.2) -> float | None:
    """How many of `cpus` sat idle over `seconds` (idle + iowait time in /proc/stat); this process
    sleeps meanwhile, so only other work counts. None where /proc/stat cannot be read."""
    import time

    def sample() -> dict[int, tuple[int, int]]:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    ticks = [int(x) for x in fields[:8]]
                    out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
        return out

    try:
        before = sample()
        time.sleep(seconds)
        after = sample()
    except (OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu, (idle_after, total_after) in after.items():
        idle_before, total_before = before.get(cpu, (idle_after, total_after))
        elapsed = total_after - total_before
        idle += (idle_after - idle_before) / elapsed if elapsed > 0 else 1.0
    return idle if after else None


def choose(
    requested: int | None,
    env: Mapping[str, str],
    cores: int,
    local_ranks: int,
    current: int,
    torch_default: int,
    idle: float | None = None,
) -> Tuple[int | None, str]:
    """(count to set or None to leave torch alone, why) for one process; `idle`: cores idle now."""
    if requested is not None:
        if requested < 1:
            raise UserError(f"threads={requested}: torch needs at least 1 thread")
        return requested, "threads="
    if env.get(THREADS_ENV):
        text = env[THREADS_ENV]
        if not text.isdigit() or int(text) < 1:
            raise UserError(f"{THREADS_ENV}={text!r}: expected a whole number of threads, at least 1")
        return int(text), THREADS_ENV
    for name in TORCH_THREAD_ENVS:
        if env.get(name):
            return None, f"{name} is set"
    if current != torch_default:
        return None, "torch.set_num_threads was called"
    usable = cores if idle is None else min(cores, max(1, round(idle)))
    share = max(1, usable // max(1, local_ranks))
    if share >= current:
        return None, "torch's count is within this rank's share of the cores"
    idle_text = "" if idle is None else f", {idle:.1f} idle"
    return share, f"{cores} cores{idle_text} / {local_ranks} local rank(s)"


def local_ranks(env: Mapping[str, str]) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else 1 (a lone process)."""
    text = env.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def apply(requested: int | None = None) -> int | None:
    """Set torch's thread count for this rank once per process (the module docstring says how it is
    chosen); says so once on the host's first rank. Returns the count set, or None."""
    global _applied
    if _applied and requested is None:
        return None
    import torch

    env = os.environ
    cpus = os.sched_getaffinity(0)
    current, default = torch.get_num_threads(), physical_cores()
    # The idle sample (0.2 s) only where the choice depends on it.
    decided = requested is not None or any(env.get(n) for n in (THREADS_ENV, *TORCH_THREAD_ENVS)) or current != default
    idle = None if decided else idle_cores(cpus)
    count, why = choose(requested, env, len(cpus), local_ranks(env), current, default, idle)
    _applied = True
    if count is None:
        return None
    torch.set_num_threads(count)
    if env.get("LOCAL_RANK", "0") == "0" and why not in ("threads=", THREADS_ENV):
        logger.warning(
            "tpurec: torch uses %d thread(s) per rank (%s); choose another count with "
            "tpurec.DistributedModelParallel(threads=N), %s=N or OMP_NUM_THREADS=N",
            count,
            why,
            THREADS_ENV,
        )
    return count
