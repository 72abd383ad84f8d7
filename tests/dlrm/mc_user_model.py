"""A user's ranker with a managed-collision table (tests/dlrm/test_user_model_mc.py): user_id through
TorchRec's ManagedCollisionEmbeddingBagCollection (100 slots, LRU eviction every 2 steps), item_id
through a plain EmbeddingBagCollection (50 rows), 2 dense features."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import LRU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule


class Ranker(torch.nn.Module):
    dense_in_features = 2

    def __init__(self, input_hash_size: int) -> None:
        super().__init__()
        users = [EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=100, feature_names=["user_id"])]
        remap = MCHManagedCollisionModule(
            zch_size=100,
            device=torch.device("cpu"),
            eviction_interval=2,
            input_hash_size=input_hash_size,
            eviction_policy=LRU_EvictionPolicy(),
        )
        self.users = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(users, device=torch.device("meta")),
            ManagedCollisionCollection({"user": remap}, users),
            return_remapped_features=False,
        )
        items = [EmbeddingBagConfig(name="item", embedding_dim=8, num_embeddings=50, feature_names=["item_id"])]
        self.item_ebc = EmbeddingBagCollection(items, device=torch.device("meta"))
        self.top = torch.nn.Linear(2 + 8 + 8, 1)

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        users, _ = self.users(sparse_features)
        items = self.item_ebc(sparse_features)
        return self.top(torch.cat([dense_features, users.values(), items.values()], dim=1))


def build() -> Ranker:
    return Ranker(2**40)  # the data's user ids are 40-bit


def small_range() -> Ranker:
    return Ranker(2**10)


def default_range() -> Ranker:  # TorchRec's default input range, no input_hash_func
    return Ranker(2**63 - 1)
