"""Run a function on N real ranks (separate processes, gloo over loopback) and collect results."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    # Plain bytes through the queue: tensors sent as-is would travel as shared-memory handles
    # that die with the rank's process.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(rank, world_size, port, fn, args, queue, init_group=True, environ=None):
    import torch
    import torch.distributed as dist

    if environ is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # 2 cores shared by all ranks
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, "ok", _dumps(fn(rank, world_size, *args))))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Modules every rank imports before its function runs, imported once by the fork server the ranks are
# forked from: a spawned rank imported torch and TorchRec itself, about 8 s of CPU a rank (of a 2-rank
# launch's 15-20 s on 2 busy cores). Nothing of tpurec or of the tests: those a rank imports after it
# has taken the parent's environment (`_entry`), as a spawned rank did. The server holds no thread.
PRELOAD = ["torch", "torch.distributed", "torchrec"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first launch of this process
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, init_group: bool = True) -> list:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order.

    fn must be importable (module-level) since ranks are spawned. With init_group=False fn creates the
    process group itself (from the MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set here), as a script
    run by torchrun does. Raises with the failing rank's
    traceback if any rank fails, or after `timeout` seconds.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, init_group, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = _loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
