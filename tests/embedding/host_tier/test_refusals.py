"""What the host tier refuses, in one line naming the table."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.types import CacheParams
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.embedding.helpers import fused_optimizers
from tpurec.embedding.kernel_table import IdOutOfRange
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.errors import UserError

from . import training


def _kjt(ids: list[int], feature: str = "f3", weights: torch.Tensor | None = None) -> KeyedJaggedTensor:
    """One sample: `ids` in `feature`'s bag, the other features empty."""
    keys = ["f0", "f1", "f2", "f3"]
    lengths = torch.tensor([len(ids) if k == feature else 0 for k in keys])
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(ids), lengths=lengths, weights=weights)


def _ebc(load_factor: float = 0.1, weighted: bool = False) -> SparseCoreEmbeddingBagCollection:
    opt = fused_optimizers()["sgd"]
    cache = {"t2": CacheParams(load_factor=load_factor)}
    kwargs = dict(opt[1])
    return SparseCoreEmbeddingBagCollection(training.TABLES, opt[0], kwargs, is_weighted=weighted, cache_params=cache)


def test_ids_are_checked_against_the_whole_table():
    ebc = _ebc()
    ebc(_kjt([0, 1999]))  # the last row of 2000, though the cache holds 200
    want = r"feature 'f3' \(table 't2'\): ids must be in \[0, 2000\), got min 5, max 2000"
    with pytest.raises(IdOutOfRange, match=want):
        ebc(_kjt([5, 2000]))


def test_a_batch_over_the_cache_names_the_table_its_need_and_the_cache():
    ebc = _ebc(load_factor=0.005)  # 10 rows of 2000
    want = (
        r"table 't2' on the host tier: a batch needs 11 distinct rows but its cache holds 10 \(load_factor 0.005 of "
        r"2000 rows\); raise cache_params.load_factor to at least 0.0055 or make the batch smaller$"
    )
    with pytest.raises(UserError, match=want) as e:
        ebc(_kjt(list(range(11))))
    assert "\n" not in str(e.value)


def test_cache_params_for_a_table_the_collection_lacks_are_refused():
    opt = fused_optimizers()["sgd"]
    with pytest.raises(UserError, match=r"cache_params name tables this kernel does not have: \['t9'\]"):
        SparseCoreEmbeddingBagCollection(training.TABLES, opt[0], dict(opt[1]), cache_params={"t9": None})


def test_trainable_per_id_weights_are_refused_on_the_host_tier():
    ebc = _ebc(weighted=True)
    ebc(_kjt([1, 2], weights=torch.tensor([0.5, 2.0])))  # weights as data: fine
    trainable = torch.tensor([0.5, 2.0], requires_grad=True)
    with pytest.raises(UserError, match="trainable per-id weights .* not supported on the host tier yet"):
        ebc(_kjt([1, 2], weights=trainable))


def test_a_lookup_without_gradients_changes_no_row_on_the_host():
    ebc = _ebc(load_factor=0.005)
    before = ebc.state_dict()["embedding_bags.t2.weight"].clone()
    with torch.no_grad():
        for start in range(0, 100, 10):
            ebc(_kjt(list(range(start, start + 10))))
    c = ebc.kernel.host_tier_counters()["t2"]
    assert (c.misses, c.evictions, c.writebacks) == (100, 90, 0)
    assert torch.equal(ebc.state_dict()["embedding_bags.t2.weight"], before)


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_sharded_lookups_on_a_device_other_than_the_cpu_or_a_tpu_are_refused(device):
    from tpurec.embedding.host_tier.kernel import HostTierKernel, host_tier_factory
    from tpurec.embedding.kernel import SparseCoreKernel

    assert host_tier_factory(SparseCoreKernel, ["t0"], torch.device("cpu")) is HostTierKernel
    # (a TPU device: tests/embedding/host_tier/test_on_tpu_device.py, on the emulated one)
    message = rf"tables \['t0'\]: the host tier .* runs on the CPU and a TPU only so far, not on {device};"
    with pytest.raises(UserError, match=message):
        host_tier_factory(SparseCoreKernel, ["t0"], torch.device(device))
