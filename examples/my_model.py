"""Your own TorchRec ranking model, trained by `tpurec train --model-module` (docs/your_model.md).

    tpurec data synth --model-module examples/my_model.py:build --rows 200000 --out /tmp/my_data
    tpurec train --model-module examples/my_model.py:build --data /tmp/my_data --steps 300
    tpurec train --model-module examples/my_model.py:build --data /tmp/my_data --emulate-tpu v5p-16
    tpurec plan --model-module examples/my_model.py:build --topology v5p-16

The model is plain TorchRec: an EmbeddingBagCollection of four tables of different sizes, dims and
pooling (one table read by two features), built on the meta device so that only the shards each rank
owns are ever allocated, and a dense part (bottom MLP over the dense features, top MLP over
everything) on the CPU. Its forward takes what tpurec's reader gives: the dense features [B, 8] and a
KeyedJaggedTensor whose keys are the data's sparse columns; it returns one logit per sample.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.planner.types import ParameterConstraints

NUM_DENSE = 8  # dense columns of the data (tpurec data synth names them I1..I8)

TABLES = [
    EmbeddingBagConfig(name="t_users", embedding_dim=16, num_embeddings=20_000, feature_names=["user_id"]),
    EmbeddingBagConfig(name="t_items", embedding_dim=16, num_embeddings=10_000, feature_names=["item_id"]),
    # the items a user saw last: 4 ids per sample, averaged
    EmbeddingBagConfig(
        name="t_history",
        embedding_dim=8,
        num_embeddings=10_000,
        feature_names=["recent_items"],
        pooling=PoolingType.MEAN,
    ),
    # one table, two features: each pooled into its own output
    EmbeddingBagConfig(name="t_context", embedding_dim=8, num_embeddings=500, feature_names=["hour", "device"]),
]

# Ids per sample of each table's features: the planner's pooling factors, and what `data synth` writes.
CONSTRAINTS = {"t_history": ParameterConstraints(pooling_factors=[4.0])}


class MyRanker(torch.nn.Module):
    """Bottom MLP over the dense features, the pooled embeddings beside it, top MLP -> one logit."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_in_features = NUM_DENSE  # how many dense columns the model takes (tpurec checks the data)
        self.sparse = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
        self.bottom = torch.nn.Sequential(torch.nn.Linear(NUM_DENSE, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        pooled = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
        self.top = torch.nn.Sequential(torch.nn.Linear(16 + pooled, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse_features).values()  # [B, sum of dims], in table and feature order
        x = torch.cat([torch.relu(self.bottom(dense_features)), pooled], dim=1)
        return self.top(x).squeeze(-1)  # [B] logits


def build() -> tuple[MyRanker, dict[str, ParameterConstraints]]:
    """What `--model-module examples/my_model.py:build` calls: the model and its constraints."""
    return MyRanker(), CONSTRAINTS
