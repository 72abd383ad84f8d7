"""The SparseCore count a layout is built for: the chip's on a TPU, refused when it disagrees."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.runtime import device


@pytest.mark.parametrize("generation,count", [("v5p", 4), ("v6e", 2), ("v7x", 2)])
def test_tpu_count_comes_from_the_chip(generation, count):
    assert resolve_num_sparsecores(None, "tpu", generation=generation) == count
    assert resolve_num_sparsecores(count, "tpu", generation=generation) == count


def test_tpu_refuses_a_count_the_chip_does_not_have():
    # A 4-SparseCore layout on a 2-SparseCore v6e would be silently wrong on TorchTPU.
    with pytest.raises(ValueError, match=r"num_sparsecores=4, but this TPU v6e has 2 SparseCores per device"):
        resolve_num_sparsecores(4, "tpu", generation="v6e")


@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_a_tpu_without_usable_sparsecores_gets_the_tensorcore_kernels_layout(generation):
    # the TensorCore kernel reads the layout for any count: one per device unless another is asked for
    assert resolve_num_sparsecores(None, "tpu", generation=generation) == 1
    assert resolve_num_sparsecores(2, "tpu", generation=generation) == 2
    assert device.tensorcore_only(generation) and not device.tensorcore_only("v5p")


def test_unknown_tpu_is_an_error_not_a_default(monkeypatch):
    monkeypatch.setattr(device, "tpu_generation", lambda: None)
    with pytest.raises(RuntimeError, match="cannot tell this TPU's SparseCore count"):
        resolve_num_sparsecores(None, "tpu")


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4"])
def test_bad_counts_are_refused_not_replaced(bad):
    with pytest.raises(ValueError, match="num_sparsecores must be a whole number >= 1"):
        resolve_num_sparsecores(bad, "cpu")


def test_cpu_takes_any_count_and_defaults_to_v5p():
    assert resolve_num_sparsecores(None, "cpu") == 4
    assert resolve_num_sparsecores(3, "cpu") == 3
    assert resolve_num_sparsecores(None, "meta") == 4


def test_module_and_sharder_use_the_resolver(monkeypatch):
    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=16, feature_names=["f"])]
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2, device="cpu")
    assert sc.kernel.num_sc == 2
    with pytest.raises(ValueError, match="num_sparsecores must be a whole number >= 1, got 0"):
        SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=0, device="cpu")
    assert SparseCoreEBCSharder().num_sparsecores is None  # resolved per device when it shards
