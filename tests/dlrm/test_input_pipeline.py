"""The training input pipeline: CSR inputs built ahead equal the step's own preprocessing (and
jax-tpu-embedding's C++ on a small case), and training with it is the same run as without it."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torch

from tpurec.data.prefetch import Prefetcher
from tpurec.data.reader import ParquetReader

MULTI_HOT = [3, 1, 7, 2]  # ids per sample of 4 features (list columns and a one-hot column)


@pytest.fixture(scope="module")
def multi_hot_dir(tmp_path_factory):
    from tpurec.data.synth import synthesize

    out = tmp_path_factory.mktemp("mh")
    synthesize(3000, str(out), seed=1, row_group_size=700, show_progress=False, multi_hot_sizes=MULTI_HOT + [1] * 22)
    return out


def _kernel(num_sc=4, **kw):
    from tpurec.data.catalog import get_table_set
    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec

    ts = get_table_set("dlrm-tiny")
    tables = [KernelTable(t.name, t.num_embeddings, 8, (t.feature,)) for t in ts.tables]
    return SparseCoreKernel(tables, SGDSpec(lr=0.1), num_sc, device="meta", **kw)


def test_csr_built_ahead_equals_the_kernels_numpy_preprocessing(multi_hot_dir, monkeypatch):
    """Parquet (list columns) -> KJT -> CSR on 2 worker threads, 3 batches ahead, equals the numpy
    route of SparseCoreKernel.preprocess on the reader's own batches, slot for slot."""
    kernel = _kernel(fixed_limits=True, max_ids_per_partition=8192)
    reader = ParquetReader(multi_hot_dir, 256, shuffle=True, seed=2, drop_last=True)
    ahead = list(Prefetcher(reader, lambda b: kernel.preprocess(b.sparse_features), depth=3, workers=2, epochs=1))
    monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    want = [kernel.preprocess(b.sparse_features) for b in ParquetReader(multi_hot_dir, 256, shuffle=True, seed=2,
                                                                         drop_last=True)]  # fmt: skip
    assert len(ahead) == len(want) > 5
    for got_b, want_b in zip(ahead, want):
        for g, w in zip(got_b, want_b):
            for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
                a, b = getattr(g, name).numpy(), getattr(w, name).numpy()
                assert np.array_equal(a.view(np.int32), b.view(np.int32)), name


def test_csr_built_ahead_equals_jax_tpu_embeddings_cpp(multi_hot_dir):
    """One multi-hot table on its own kernel: the pipeline's CSR of a Parquet batch is what
    jax-tpu-embedding's C++ builds from the same ids (renamed as the natural-order storage does)."""
    pytest.importorskip("jax_tpu_embedding")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tests.embedding.jte_oracle import RaggedBatch, assert_same_as_cpp, jte_cpp
    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec

    batch = next(iter(ParquetReader(multi_hot_dir, 64, drop_last=True)))
    feat = batch.sparse_features["C3"]  # 7 ids per sample
    rows = 1000
    kernel = SparseCoreKernel(
        [KernelTable("t", rows, 8, ("C3",))], SGDSpec(lr=0.1), 4, device="meta", fixed_limits=False
    )
    kjt = batch.sparse_features.permute([2])
    got = list(Prefetcher(_List([kjt]), kernel.preprocess, depth=2, epochs=1))[0][0]
    lay = kernel.stacks[0].layout
    renamed = lay.sparsecore_ids(feat.values().long()).numpy().astype(np.int32)
    lengths = feat.lengths().tolist()
    starts = np.cumsum([0] + lengths)
    ragged = RaggedBatch(
        [renamed[a:b] for a, b in zip(starts[:-1], starts[1:])], [np.ones(n, np.float32) for n in lengths]
    )
    theirs = jte_cpp(ragged, num_sc=4, num_devices=1, max_ids=got.max_ids_per_partition,
                     max_uniq=got.max_unique_ids_per_partition, vocab=lay.total_rows)  # fmt: skip
    assert_same_as_cpp(got, theirs.per_device[0])


class _List:
    """A list as a reader (state = position), for feeding prepared KJTs through a Prefetcher."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def __iter__(self):
        while self.i < len(self.items):
            self.i += 1
            yield self.items[self.i - 1]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _trainer(cache, monkeypatch, *args):
    from tpurec.dlrm.options import TrainOptions
    from tpurec.dlrm.trainer import Trainer

    monkeypatch.setenv("TPUREC_CACHE", str(cache))
    p = argparse.ArgumentParser()
    TrainOptions.add_arguments(p)
    t = Trainer(TrainOptions.from_args(p.parse_args(["--quiet", "--synth-rows", "20000", "--steps", "12", *args])))
    t.setup()
    return t


def test_one_rank_training_uses_the_inputs_built_ahead_and_is_the_same_run(cache, monkeypatch):
    # The SparseCore layout path (the one a TPU takes): on the CPU, with no id limits, the kernels
    # take the direct step instead, which needs no inputs built ahead (the test below).
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    ahead = _trainer(cache, monkeypatch, "--pipeline-depth", "3")
    assert ahead.data.lookups, "no SparseCore lookup found to build inputs for"
    losses = [ahead.step() for _ in range(12)]
    assert sum(m.prepared_hits for m in ahead.data.lookups) == 12 * len(ahead.data.lookups)
    assert sum(m.prepared_misses for m in ahead.data.lookups) == 0
    state = ahead.data.train_state()
    ahead.data.prefetch.close()
    inline = _trainer(cache, monkeypatch, "--pipeline-depth", "0")
    assert [inline.step() for _ in range(12)] == losses  # bit for bit: the same batches and inputs
    assert state == inline.readers.train.state_dict()  # the position of the last batch trained


def test_on_the_direct_cpu_step_nothing_is_built_ahead_and_the_run_is_the_same(cache, monkeypatch):
    monkeypatch.delenv("TPUREC_NO_DIRECT", raising=False)
    ahead = _trainer(cache, monkeypatch, "--pipeline-depth", "3")
    assert ahead.data.lookups
    losses = [ahead.step() for _ in range(6)]
    assert [m._prepared for m in ahead.data.lookups] == [[]] * len(ahead.data.lookups)
    assert sum(m.prepared_hits + m.prepared_misses for m in ahead.data.lookups) == 0
    ahead.data.prefetch.close()
    inline = _trainer(cache, monkeypatch, "--pipeline-depth", "0")
    assert [inline.step() for _ in range(6)] == losses  # bit for bit: both took the direct step


def test_inputs_prepared_later_on_a_thread_are_waited_for_and_used(cache, monkeypatch):
    """The several-rank route: a Future per lookup (built after input dist), taken in forward."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")  # the layout path (on the direct step nothing is built)
    t = _trainer(cache, monkeypatch, "--pipeline-depth", "0")
    from tpurec.dlrm.input_pipeline import sparsecore_lookups

    (m,) = sparsecore_lookups(t.dmp)
    batch = next(iter(t.readers.train))
    kjt = batch.sparse_features.permute([batch.sparse_features.keys().index(k) for k in m.feature_keys()])
    want = m(kjt)
    with ThreadPoolExecutor(1) as pool:
        m.prepare_later(kjt, pool.submit)
        got = m(kjt)
    assert m.prepared_hits == 1 and torch.equal(got, want)


@pytest.mark.slow  # two 2-rank runs, ~25 s each on an idle host
def test_two_ranks_build_inputs_after_input_dist_and_train_the_same(tmp_path, monkeypatch):
    from tests.dlrm.helpers import train

    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")  # the SparseCore layout path, whose inputs are built ahead

    with_pipeline, p = train("--nproc", 2, "--steps", 24, "--synth-rows", 20000, cache=tmp_path)
    assert "SparseCore inputs built ahead for 24 of 24 lookups" in p.stderr
    inline, _ = train("--nproc", 2, "--steps", 24, "--synth-rows", 20000, "--pipeline-depth", 0, cache=tmp_path)
    for k in ("auc", "ne", "logloss", "accuracy"):
        assert with_pipeline[k] == inline[k], k
