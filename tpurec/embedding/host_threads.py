"""A thread pool for a batch's independent host work per table stack (KernelInput.preprocess).

Each stack's compiled CSR build (csr_build.stack_csr) is numba loops and a sort that release the GIL,
so the stacks of one batch build side by side on threads: MLPerf DLRM-DCNv2's 8 stacks on a 13-core
TPU v5e host (`python -m tpurec.bench.host_prep` measures it). TPUREC_HOST_THREADS caps the threads
(1: one stack after another, in the calling thread); unset, min(stacks, os.cpu_count()).

One pool per process and size, made on first use: a pipeline's workers that preprocess side by side
share it rather than each starting threads. A forked child (a DataLoader worker) gets fresh pools: the
parent's threads do not exist there, and a pool that waits on them would hang.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

from tpurec.errors import UserError
from tpurec.runtime import env_flags
from tpurec.runtime.rank_exit import OWN_POOL_PREFIXES

SWITCH = "TPUREC_HOST_THREADS"
T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_pid = os.getpid()
_lock = threading.Lock()


def workers(tasks: int) -> int:
    """Threads for `tasks` independent tasks: TPUREC_HOST_THREADS's cap, else the host's cores."""
    value = env_flags.get(SWITCH)
    if value in (None, ""):
        cap = os.cpu_count() or 1
    else:
        try:
            cap = int(value)
        except ValueError:
            cap = 0
        if cap < 1:
            raise UserError(f"{SWITCH}={value!r}: expected a whole number >= 1 (1: no threads)")
    return max(1, min(tasks, cap))


def _pool(size: int) -> ThreadPoolExecutor:
    global _pid
    with _lock:
        if os.getpid() != _pid:  # forked: the parent's threads are not in this process
            _pools.clear()
            _pid = os.getpid()
        pool = _pools.get(size)
        if pool is None:
            # the name tells a program's ending not to wait for these idle workers (rank_exit)
            pool = _pools[size] = ThreadPoolExecutor(size, thread_name_prefix=OWN_POOL_PREFIXES[0])
        return pool


def map_tasks(fn: Callable[[int], T], tasks: int, sizes: Sequence[int] | None = None) -> list[T]:
    """[fn(0), .., fn(tasks - 1)] in order, on up to `workers(tasks)` threads (in this thread when 1).
    fn must touch no shared state: its results are all a caller gets back. `sizes`: each task's work
    (any unit); the largest start first, so that one big task (MLPerf's 1.6M-id stack: half the
    batch's ids) is not left to start last while the other threads idle."""
    n = workers(tasks)
    if n <= 1:
        return [fn(i) for i in range(tasks)]
    order = sorted(range(tasks), key=lambda i: -sizes[i]) if sizes is not None else list(range(tasks))
    futures = {i: _pool(n).submit(fn, i) for i in order}
    return [futures[i].result() for i in range(tasks)]
