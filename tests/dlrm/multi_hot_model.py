"""A ranking model whose largest table is read multi-hot, as MLPerf DLRM-DCNv2's are (10 ids a sample
here; MLPerf's run 1 to 100): for `tpurec data synth / data stats / plan / train --model-module` in
tests/dlrm/test_train_host_tier.py (the host tier's expected hit rate on multi-hot data)."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner.types import ParameterConstraints

NUM_DENSE = 4
HOTS = 10  # ids a sample of t_multi's feature
TABLES = [
    EmbeddingBagConfig(name="t_multi", embedding_dim=8, num_embeddings=20_000, feature_names=["clicked"]),
    EmbeddingBagConfig(name="t_one", embedding_dim=8, num_embeddings=500, feature_names=["site"]),
]
CONSTRAINTS = {"t_multi": ParameterConstraints(pooling_factors=[float(HOTS)])}


class MultiHotRanker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_in_features = NUM_DENSE
        self.sparse = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
        self.top = torch.nn.Linear(NUM_DENSE + sum(t.embedding_dim for t in TABLES), 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse_features).values()
        return self.top(torch.cat([dense_features, pooled], dim=1)).squeeze(-1)


def build() -> tuple[MultiHotRanker, dict[str, ParameterConstraints]]:
    return MultiHotRanker(), CONSTRAINTS
