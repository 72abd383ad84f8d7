"""The benchmarks' shared timer and workload generator."""

import gc

import numpy as np
import pytest

from tpurec.bench import timer, workloads


def test_interleaved_takes_turns_in_a_fresh_random_order_and_keeps_every_run():
    calls = []
    fns = [lambda: calls.append("a") or 1, lambda: calls.append("b") or 2]
    a, b = timer.interleaved(fns, warmup=2, repeats=12)
    assert calls[:4] == ["a", "b"] * 2  # warm-up rounds
    rounds = [tuple(calls[i : i + 2]) for i in range(4, len(calls), 2)]
    assert all(sorted(r) == ["a", "b"] for r in rounds)  # every round runs each once
    assert {("a", "b"), ("b", "a")} == set(rounds)  # in either order (seeded: the same every run)
    assert a.results == [1] * 12 and b.results == [2] * 12
    assert len(a.wall) == len(a.cpu) == 12 and all(t >= 0 for t in a.wall + a.cpu)
    assert a.best <= a.median <= max(a.wall)


def test_timed_rounds_run_with_the_process_objects_frozen_and_the_warmup_not():
    """A full collection in a timed run scans only what the contestants made (the rest frozen)."""
    seen = []
    timer.interleaved([lambda: seen.append(gc.get_freeze_count())], warmup=1, repeats=3)
    assert seen[0] == 0  # warm-up: nothing frozen yet
    assert all(n > 10_000 for n in seen[1:])  # timed: the imported modules' objects, frozen
    assert gc.get_freeze_count() == 0  # and thawed after


def test_repeat_and_stopwatch():
    runs = timer.repeat(lambda: sum(range(1000)), warmup=0, repeats=5)
    assert runs.results == [499500] * 5 and runs.median == sorted(runs.wall)[2]
    with timer.Stopwatch() as sw:
        sum(range(10_000))
    assert sw.wall > 0 and sw.cpu >= 0


def test_zipf_ids_fold_into_the_vocabulary_and_scatter():
    plain = workloads.zipf_ids(np.random.default_rng(0), (64, 5), 1000)
    assert plain.shape == (64, 5) and plain.min() >= 0 and plain.max() < 1000
    # Folding: numpy's discrete law, rank z -> (z - 1) % vocab, same draws as rng.zipf directly.
    assert np.array_equal(plain, (np.random.default_rng(0).zipf(workloads.ZIPF_A, (64, 5)) - 1) % 1000)
    counts = np.bincount(plain.reshape(-1), minlength=1000)
    assert counts[0] == counts.max()  # rank 1 is the hottest id
    scattered = workloads.zipf_ids(np.random.default_rng(0), (64, 5), 1000, scatter_seed=7)
    perm = np.random.default_rng(7).permutation(1000)
    assert np.array_equal(scattered, perm[plain])
    # [batch, pooling] at once gives the same ids as batch * pooling.
    flat = workloads.zipf_ids(np.random.default_rng(0), 320, 1000)
    assert np.array_equal(flat, plain.reshape(-1))


def test_kjt_of_fixed_pooling_features():
    ids = workloads.fixed_pooling_ids(np.random.default_rng(1), 3, batch=4, pooling=2, vocab=50)
    assert [x.shape for x in ids] == [(4, 2)] * 3
    kjt = workloads.kjt(ids, ["f0", "f1", "f2"])
    assert kjt.keys() == ["f0", "f1", "f2"] and kjt.stride() == 4
    assert kjt.lengths().tolist() == [2] * 12
    assert kjt["f1"].values().tolist() == ids[1].reshape(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 7])
def test_tiny_vocabularies(vocab):
    assert workloads.zipf_ids(np.random.default_rng(0), 100, vocab).max() < vocab
