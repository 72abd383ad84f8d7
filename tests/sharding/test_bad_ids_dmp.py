"""Ids outside a table under tpurec's DMP: one line naming the user's feature and table (issue 63 item 6),
not the kernel's names for a shard's slot and table (`feature '1:item_id' (table 't_items/0')`)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from tpurec.errors import UserError

TABLES = [
    EmbeddingBagConfig(name="t_users", embedding_dim=8, num_embeddings=100, feature_names=["user_id"]),
    EmbeddingBagConfig(name="t_items", embedding_dim=8, num_embeddings=50, feature_names=["item_id", "item2"]),
]


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
@pytest.mark.parametrize("direct", ["1", ""])  # the SparseCore layout's input path, and the direct CPU path
def test_an_id_past_the_table_names_the_users_feature_and_table(sharding, direct, monkeypatch):
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    import tpurec
    from tpurec.sharding.dmp import _ensure_process_group

    monkeypatch.setenv("TPUREC_NO_DIRECT", direct)
    _ensure_process_group("cpu")
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    per_table = table_wise(rank=0) if sharding == "table_wise" else column_wise(ranks=[0, 0])
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {t.name: per_table for t in TABLES})})
    model = tpurec.DistributedModelParallel(ebc, device="cpu", plan=plan)
    kjt = KeyedJaggedTensor(
        keys=["user_id", "item_id", "item2"],
        values=torch.tensor([1, 2, 3, 60, 7]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 0]),
    )
    with pytest.raises(UserError) as raised:
        model(kjt).values().sum().backward()
    assert isinstance(raised.value, IndexError)  # as before: code catching IndexError still does
    assert str(raised.value) == "feature 'item_id' (table 't_items'): ids must be in [0, 50), got min 3, max 60"
