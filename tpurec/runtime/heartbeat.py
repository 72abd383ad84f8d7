"""A heartbeat over the c10d store: a rank that stops (SIGSTOP, a hang holding the GIL, a lost host)
is named by its neighbours within a bounded time, instead of every other rank waiting in a collective
for gloo's default of 30 minutes.

Each rank's daemon thread increments its counter `tpurec/heartbeat/R` in the process group's store
every `timeout / 5` seconds and reads the counters of its two ring neighbours (R-1, R+1; two reads per
rank per beat, so the store's load grows with the world size, not its square). A neighbour whose
counter has not moved for `timeout` seconds is silent: the watching rank prints one line naming it and
leaves with EXIT_PEER_SILENT, so the launcher (torch.distributed.run) stops the job. The thread keeps
beating while its rank waits in a collective or writes a long checkpoint (those release the GIL), so
a short timeout raises no false alarm for slow work. A rank that finishes says so (`stop()`), and
its neighbours stop watching it. Counters, not clocks: hosts' clocks need not agree.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpurec.errors import UserError

if TYPE_CHECKING:
    import torch.distributed as dist

TIMEOUT_ENV = "TPUREC_HEARTBEAT_TIMEOUT"  # seconds; 0 turns the heartbeat off
DIST_TIMEOUT_ENV = "TPUREC_DIST_TIMEOUT"  # seconds a collective may wait (the process group's timeout)
DEFAULT_TIMEOUT = 60.0
DEFAULT_DIST_TIMEOUT = 600.0  # NCCL's default; gloo's own is 30 minutes
EXIT_PEER_SILENT = 3  # a rank left because another went silent or its connection broke (not a user error)
_PREFIX = "tpurec/heartbeat/"


def seconds_from_env(name: str, default: float) -> float:
    """A positive (or 0) number of seconds from environment variable `name`; UserError naming it."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise UserError(f"{name}={text!r} must be a finite number of seconds >= 0")
    return value


# What gloo says (as a plain RuntimeError) when a peer's process is gone or a collective timed out.
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe")


def lost_peer(error: BaseException) -> bool:
    """True for the error a collective raises when another rank died or never came (not this rank's
    fault): torch's DistError family, or gloo's RuntimeError naming a closed connection or a timeout."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _LOST_PEER_MARKERS)


def neighbours(rank: int, world: int) -> list[int]:
    return sorted({(rank - 1) % world, (rank + 1) % world} - {rank})


class Heartbeat:
    """Beats for `rank` and watches its ring neighbours. `on_silent(rank, message)` is called once,
    from the heartbeat thread, when a neighbour goes silent or the store stops answering; by default
    it prints the message and ends the process (the main thread may be stuck in a collective)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        timeout: float,
        program: str = "tpurec",
        on_silent: Callable[[int, str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world, self.timeout = store, rank, world, float(timeout)
        self.interval = max(0.05, self.timeout / 5)
        self.program = program
        self.on_silent = on_silent or _leave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpurec-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.store.set(f"{_PREFIX}where/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()  # before the thread: a neighbour's first read already sees this rank alive
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop beating; with `done`, tell the neighbours this rank finished (not silent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if done:
            try:
                self.store.set(f"{_PREFIX}done/{self.rank}", "1")
            except Exception:  # the store may already be gone at exit; nothing to tell then
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)

    def _beat(self) -> None:
        self.store.add(f"{_PREFIX}{self.rank}", 1)

    def _run(self) -> None:
        peers = neighbours(self.rank, self.world)
        last = dict.fromkeys(peers, -1)
        moved = dict.fromkeys(peers, time.monotonic())
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                for r in list(peers):
                    count = self.store.add(f"{_PREFIX}{r}", 0)  # add 0: read without blocking on a missing key
                    now = time.monotonic()
                    if count != last[r]:
                        last[r], moved[r] = count, now
                    elif self.store.check([f"{_PREFIX}done/{r}"]):
                        peers.remove(r)  # finished: not silent
                    elif now - moved[r] > self.timeout:
                        self._silent(
                            r,
                            f"rank {r} has sent no heartbeat for {now - moved[r]:.0f} s (stopped, hung or its "
                            f"host is down); stopping rank {self.rank} so the job ends (wait set by "
                            f"--heartbeat-timeout / {TIMEOUT_ENV}={self.timeout:g})",
                        )
                        return
            except Exception as e:  # the store's host is gone: no rank can make progress
                if self._stop.is_set():
                    return
                self._silent(-1, f"the process group's store stopped answering ({type(e).__name__}: {e})")
                return

    def _silent(self, rank: int, what: str) -> None:
        self._stop.set()
        if rank >= 0:
            self._wake(rank)
        self.on_silent(rank, f"{self.program}: error: rank {self.rank}: {what}")

    def _wake(self, rank: int) -> None:
        """SIGCONT a silent rank on this host: a stopped process cannot act on the SIGTERM the
        launcher sends once this rank leaves, and torch.distributed.run waits 30 s before SIGKILL
        (a running process ignores SIGCONT)."""
        try:
            key = f"{_PREFIX}where/{rank}"
            if not self.store.check([key]):
                return
            host, pid = self.store.get(key).decode().split()
            if host == socket.gethostname():
                os.kill(int(pid), signal.SIGCONT)
        except (OSError, ValueError, RuntimeError):
            pass  # gone already, or not ours to signal


def _leave(_rank: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_SILENT)  # not sys.exit: the main thread may be blocked in a collective


_current: Heartbeat | None = None


def start(timeout: float | None = None, program: str = "tpurec") -> Heartbeat | None:
    """Start this process's heartbeat on the default process group's store, once (later calls
    return the running one). `timeout` None: TPUREC_HEARTBEAT_TIMEOUT, else DEFAULT_TIMEOUT; 0 or a
    world of one rank: no heartbeat (None)."""
    global _current
    import torch.distributed as dist

    if _current is not None:
        return _current
    timeout = seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT) if timeout is None else timeout
    if not timeout or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    _current = Heartbeat(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout, program).start()
    atexit.register(stop)
    return _current


def stop(done: bool = True) -> None:
    """Stop this process's heartbeat (if any); `done`: the rank finished, its neighbours stop watching."""
    global _current
    if _current is not None:
        _current.stop(done)
        _current = None
