"""Prefetcher: the reader's batches in order, transformed ahead on worker threads, resumable exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from tpurec.data.prefetch import Prefetcher
from tpurec.data.reader import ParquetReader


def _key(batch):
    kjt = batch.sparse_features
    return (batch.labels.tolist(), kjt.values().tolist(), kjt.lengths().tolist(), batch.dense_features.sum().item())


def _reader(path, **kw):
    return ParquetReader(path, 256, shuffle=True, seed=5, shuffle_buffer=1500, drop_last=True, **kw)


def test_same_batches_in_order_as_the_reader_with_parallel_transform(synth_dir):
    want = [_key(b) for b in _reader(synth_dir)]
    names = set()

    def slow_transform(batch):  # runs on a worker thread; out-of-order finishing must not reorder
        names.add(threading.current_thread().name)
        torch.manual_seed(len(batch.labels))
        return _key(batch)

    got = list(Prefetcher(_reader(synth_dir), slow_transform, depth=5, workers=3, epochs=1))
    assert got == want
    assert all(n.startswith("tpurec-pipeline") for n in names)


def test_resume_mid_epoch_gives_the_uninterrupted_batches(synth_dir):
    uninterrupted = [_key(b) for b in Prefetcher(_reader(synth_dir), depth=3, epochs=2)]
    pf = Prefetcher(_reader(synth_dir), depth=3, epochs=2)
    it = iter(pf)
    head = [_key(next(it)) for _ in range(7)]  # the producer has read further ahead by now
    state = pf.state_dict()
    pf.close()
    # A new process: a fresh reader and prefetcher from the saved state.
    resumed = Prefetcher(_reader(synth_dir), depth=3, epochs=2)
    resumed.load_state_dict(state)
    rest = [_key(b) for b in resumed]
    assert head + rest[: len(uninterrupted) - 7] == uninterrupted


def test_resume_at_an_epoch_end_continues_with_the_next_epoch(synth_dir):
    reader = _reader(synth_dir)
    n = len(reader)
    pf = Prefetcher(reader, depth=2)
    it = iter(pf)
    for _ in range(n):
        next(it)
    state = pf.state_dict()
    pf.close()
    again = Prefetcher(_reader(synth_dir), depth=2)
    again.load_state_dict(state)
    first_of_next = next(iter(again))
    again.close()
    ref = _reader(synth_dir)
    ref.set_epoch(1)
    assert _key(first_of_next) == _key(next(iter(ref)))


def test_transform_errors_reach_the_consumer():
    class Boom(RuntimeError):
        pass

    class Rows:
        def __init__(self):
            self.i = 0

        def __iter__(self):
            while self.i < 5:
                self.i += 1
                yield self.i

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, s):
            self.i = s["i"]

    def transform(x):
        if x == 3:
            raise Boom("batch 3")
        return x

    got = []
    with pytest.raises(Boom, match="batch 3"):
        for x in Prefetcher(Rows(), transform, depth=4, workers=2, epochs=1):
            got.append(x)
    assert got == [1, 2]
