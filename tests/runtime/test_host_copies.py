"""Device->host copies on the TPU path: made through tpurec.runtime.host_copies, counted, and avoided for ids."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingConfig

from tests.embedding.helpers import make_tables, random_kjt
from tpurec.data.host_ids import HostIdsBatch, keep_ids_on_host, mark_plain_batch_moves
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection
from tpurec.runtime import host_copies
from tpurec.runtime.device import EMULATE_ENV


@pytest.fixture(autouse=True)
def _fresh_counts():
    host_copies.reset()
    yield
    host_copies.reset()


def _batch(gen) -> Batch:
    return Batch(torch.rand(6, 3), random_kjt(make_tables(), 6, gen), torch.rand(6))


def test_host_tensors_are_returned_as_they_are_and_device_ones_counted_by_what():
    t = torch.arange(4.0)
    assert host_copies.to_host(t, "loss") is t and host_copies.counts() == {}
    host_copies.mark_on_device(t)
    assert torch.equal(host_copies.to_host(t, "loss"), torch.arange(4.0))
    assert host_copies.to_host(t, "loss") is t  # an emulated device tensor is a CPU tensor already
    assert host_copies.counts() == {"loss": 2} and host_copies.total() == 2


def test_the_pooled_and_sequence_kernels_count_a_device_kjt_they_preprocess():
    gen = torch.Generator().manual_seed(0)
    tables = make_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    kjt = random_kjt(tables, 5, gen)
    want = ebc(kjt).values()
    assert host_copies.counts() == {}  # host ids: nothing to copy
    host_copies.mark_on_device(kjt.values())
    assert torch.equal(ebc(kjt).values(), want)
    assert host_copies.counts() == {"ids": 1}
    seq_tables = [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=20, feature_names=["a"])]
    ec = SparseCoreEmbeddingCollection(seq_tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    seq = random_kjt([type("T", (), {"feature_names": ["a"], "num_embeddings": 20})()], 5, gen)
    host_copies.mark_on_device(seq.lengths())
    ec(seq)
    assert host_copies.counts() == {"ids": 2}


def test_a_host_ids_batch_moves_dense_features_and_labels_but_not_the_ids(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    plain = _batch(gen)
    moved = keep_ids_on_host(plain).to(torch.device("meta"))  # meta: a device that is not the host
    assert moved.dense_features.device.type == "meta" and moved.labels.device.type == "meta"
    assert moved.sparse_features is plain.sparse_features
    assert isinstance(moved, HostIdsBatch) and keep_ids_on_host(moved) is moved
    # On an emulated TPU rank the device is the CPU: what moved is marked, the ids are not.
    monkeypatch.setenv(EMULATE_ENV, "v5p-8")
    moved = keep_ids_on_host(plain).to(torch.device("cpu"))
    assert host_copies.on_device(moved.dense_features) and host_copies.on_device(moved.labels)
    assert not host_copies.on_device(moved.sparse_features.values())
    assert not host_copies.on_device(plain.dense_features)  # the host original stays a host tensor


def test_on_an_emulated_rank_torchrecs_batch_moves_the_ids_to_the_device(monkeypatch):
    monkeypatch.setattr(Batch, "to", Batch.to)  # restored after the test
    mark_plain_batch_moves()
    plain = _batch(torch.Generator().manual_seed(2))
    moved = plain.to(torch.device("cpu"))
    assert host_copies.on_device(moved.sparse_features.values())
    assert host_copies.on_device(moved.dense_features)
    assert torch.equal(moved.sparse_features.values(), plain.sparse_features.values())
    assert not host_copies.on_device(plain.sparse_features.values())
