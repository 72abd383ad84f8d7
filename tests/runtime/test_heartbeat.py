"""The heartbeat names a rank that stops beating, and only that one, within its timeout (threads on
one real c10d store here; tests/reliability/test_rank_faults.py does it with real ranks)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from tpurec.runtime import heartbeat
from tpurec.runtime.heartbeat import Heartbeat


class _Recorder:
    def __init__(self):
        self.calls, self.event = [], threading.Event()

    def __call__(self, rank, message):
        self.calls.append((rank, message))
        self.event.set()


def _ring(world, timeout=0.5):
    store = dist.HashStore()
    recorders = [_Recorder() for _ in range(world)]
    beats = [Heartbeat(store, r, world, timeout, "t", on_silent=recorders[r]).start() for r in range(world)]
    return store, beats, recorders


def test_a_rank_that_stops_beating_is_named_by_its_neighbours_within_the_timeout():
    _, beats, seen = _ring(3)
    try:
        t0 = time.monotonic()
        beats[1].stop(done=False)  # as SIGSTOP: no beat, no goodbye
        assert seen[0].event.wait(5) and seen[2].event.wait(5)
        assert time.monotonic() - t0 < 0.5 + 3 * beats[0].interval
        for r in (0, 2):
            rank, message = seen[r].calls[0]
            assert rank == 1 and message.startswith(f"t: error: rank {r}: rank 1 has sent no heartbeat for")
            assert "--heartbeat-timeout" in message
    finally:
        for b in beats:
            b.stop()


def test_ranks_that_finish_or_keep_beating_are_never_called_silent():
    _, beats, seen = _ring(2)
    try:
        time.sleep(1.5)  # three timeouts with both beating
        beats[1].stop(done=True)  # finished: said so
        time.sleep(1.5)
        assert seen[0].calls == [] and seen[1].calls == []
    finally:
        beats[0].stop()


def test_a_store_that_stops_answering_is_reported_once():
    class Broken:
        def __init__(self):
            self.fail = False

        def set(self, *_):
            pass

        def add(self, *_):
            if self.fail:
                raise RuntimeError("Connection reset by peer")
            return 1

        def check(self, _):
            return False

    store, seen = Broken(), _Recorder()
    beat = Heartbeat(store, 0, 2, 0.5, "t", on_silent=seen).start()
    store.fail = True
    assert seen.event.wait(5)
    beat.stop()
    assert len(seen.calls) == 1 and "the process group's store stopped answering" in seen.calls[0][1]


def test_neighbours_form_a_ring():
    assert heartbeat.neighbours(0, 2) == [1]
    assert heartbeat.neighbours(0, 5) == [1, 4] and heartbeat.neighbours(4, 5) == [0, 3]


@pytest.mark.parametrize("text,ok", [("", 60.0), ("7.5", 7.5), ("0", 0.0), ("-1", None), ("nan", None), ("x", None)])
def test_timeouts_from_the_environment_are_checked(monkeypatch, text, ok):
    monkeypatch.setenv(heartbeat.TIMEOUT_ENV, text)
    if ok is None:
        with pytest.raises(ValueError, match=heartbeat.TIMEOUT_ENV):
            heartbeat.seconds_from_env(heartbeat.TIMEOUT_ENV, 60.0)
    else:
        assert heartbeat.seconds_from_env(heartbeat.TIMEOUT_ENV, 60.0) == ok


def test_gloos_lost_peer_errors_are_told_from_other_runtime_errors():
    gloo = "[/x/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:27045. This is typically"
    assert heartbeat.lost_peer(RuntimeError(gloo))
    assert heartbeat.lost_peer(dist.DistBackendError("anything"))
    assert not heartbeat.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
