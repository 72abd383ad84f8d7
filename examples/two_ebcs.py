"""A ranking model of two TorchRec EmbeddingBagCollections (users' tables and items' apart), both handed
the batch's one KeyedJaggedTensor: each takes its own features, as TorchRec's input distribution
selects them (docs/your_model.md).

    tpurec data synth --model-module examples/two_ebcs.py:build --rows 20000 --out /tmp/two_data
    tpurec data stats /tmp/two_data --model-module examples/two_ebcs.py:build --topology cpu-1 \
        --batch-size 256 --out /tmp/two_limits.json
    tpurec train --model-module examples/two_ebcs.py:build --data /tmp/two_data --steps 20 \
        --batch-size 256 --step compiled --limits /tmp/two_limits.json
"""

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

NUM_DENSE = 4
USERS = [EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=5000, feature_names=["user_id"])]
ITEMS = [
    EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=3000, feature_names=["item_id"]),
    EmbeddingBagConfig(name="t_cat", embedding_dim=8, num_embeddings=100, feature_names=["category"]),
]


class TwoTower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_in_features = NUM_DENSE
        self.users = EmbeddingBagCollection(tables=USERS, device=torch.device("meta"))
        self.items = EmbeddingBagCollection(tables=ITEMS, device=torch.device("meta"))
        self.bottom = torch.nn.Linear(NUM_DENSE, 8)
        self.top = torch.nn.Linear(8 + 8 + 16, 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        u = self.users(sparse_features).values()
        i = self.items(sparse_features).values()
        return self.top(torch.cat([torch.relu(self.bottom(dense_features)), u, i], dim=1)).squeeze(-1)


def build() -> tuple[TwoTower, dict]:
    return TwoTower(), {}
