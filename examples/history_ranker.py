"""A ranking model that reads each user's recent items unpooled (a TorchRec EmbeddingCollection: one
embedding per id) and weighs them by their match with the candidate item (target attention, as in
DIN), beside an EmbeddingBagCollection of the user and the candidate (docs/your_model.md).

    tpurec data synth --model-module examples/history_ranker.py:build --rows 20000 --out /tmp/hist_data
    tpurec data stats /tmp/hist_data --model-module examples/history_ranker.py:build --topology cpu-1 \
        --batch-size 256 --out /tmp/hist_limits.json
    tpurec train --model-module examples/history_ranker.py:build --data /tmp/hist_data --steps 20 \
        --batch-size 256 --step compiled --limits /tmp/hist_limits.json

Under `--step compiled|pipelined` the EmbeddingCollection's output is on its fixed-shape path: each
feature's `values()` padded past its ids to a fixed capacity with zero rows. The forward reads the
history through `to_padded_dense` (which takes each sample's ids by its offsets), so it sees the same
tensor on either path.
"""

import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed.planner.types import ParameterConstraints

NUM_DENSE = 4
HISTORY = 8  # the recent items per sample (`data synth` writes this many: the pooling factor below)
DIM = 16
PROFILE = [
    EmbeddingBagConfig(name="t_users", embedding_dim=DIM, num_embeddings=20_000, feature_names=["user_id"]),
    EmbeddingBagConfig(name="t_items", embedding_dim=DIM, num_embeddings=10_000, feature_names=["item_id"]),
]
SEQUENCE = [EmbeddingConfig(name="t_history", embedding_dim=DIM, num_embeddings=10_000, feature_names=["history"])]
CONSTRAINTS = {"t_history": ParameterConstraints(pooling_factors=[float(HISTORY)])}


class HistoryRanker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_in_features = NUM_DENSE
        self.profile = EmbeddingBagCollection(tables=PROFILE, device=torch.device("meta"))
        self.sequence = EmbeddingCollection(tables=SEQUENCE, device=torch.device("meta"))
        self.bottom = torch.nn.Linear(NUM_DENSE, DIM)
        self.top = torch.nn.Sequential(torch.nn.Linear(4 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        profile = self.profile(sparse_features)
        user, item = profile["user_id"], profile["item_id"]  # [B, DIM] each
        # [B, HISTORY, DIM]: a sample's items in order, zero rows past them
        history = self.sequence(sparse_features)["history"].to_padded_dense(desired_length=HISTORY)
        weight = torch.sigmoid((history * item.unsqueeze(1)).sum(-1, keepdim=True))  # each item's match
        interest = (weight * history).sum(1)  # zero rows add nothing: no mask needed
        x = torch.cat([torch.relu(self.bottom(dense_features)), user, item, interest], dim=1)
        return self.top(x).squeeze(-1)


def build() -> tuple[HistoryRanker, dict[str, ParameterConstraints]]:
    return HistoryRanker(), CONSTRAINTS
