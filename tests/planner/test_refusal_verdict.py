"""A refused plan names the limit that refused it: the reservation, the tables together, or the largest
table; free memory is never shown below zero."""

from __future__ import annotations

import re

import pytest
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tests.planner.conftest import ebc_for
from tpurec.planner import planners as P
from tpurec.planner.topology import make_topology


def _refusal(ebc, slice_name, batch_size, **kw) -> str:
    with pytest.raises(P.PlanDoesNotFit) as e:
        P.plan(ebc, make_topology(slice_name), batch_size=batch_size, **kw)
    msg = str(e.value)
    assert not re.search(r"-\d[\d.]* [KMGT]?i?B", msg), msg  # no negative byte count anywhere
    return msg


def test_the_slice_total_is_named_when_it_is_the_limit(mlperf):
    ebc, cons = mlperf
    msg = _refusal(ebc, "v6e-8", 8192, constraints=cons, optimizer="adagrad")
    # 26 tables need 389.45 GiB with the update's transient copy; 8 x 28.11 GiB are free
    assert "the tables together are the limit: all 26 tables need at least 389.45 GiB" in msg
    assert "against 224.87 GiB free on the whole slice" in msg
    assert msg.index("the tables together") < msg.index("the largest table t_C21")


def test_a_reservation_larger_than_a_device_is_named_with_the_batch():
    ebc = ebc_for("dlrm-tiny")
    msg = _refusal(ebc, "cpu-1", 100_000_000, optimizer="sgd")
    assert "the reservation alone" in msg and "for batch 100,000,000 per device" in msg
    assert "plan a smaller batch per device" in msg


def test_the_largest_table_is_named_when_it_alone_is_the_limit():
    big = EmbeddingBagConfig(name="big", embedding_dim=128, num_embeddings=70_000_000, feature_names=["f"])
    small = EmbeddingBagConfig(name="small", embedding_dim=128, num_embeddings=10, feature_names=["g"])
    tw = {n: P.ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for n in ("big", "small")}
    msg = _refusal(ebc_for([big, small]), "v6e-4", 64, optimizer="sgd", constraints=tw)
    assert "the largest table is the limit: the largest table big (70,000,000 x 128)" in msg
