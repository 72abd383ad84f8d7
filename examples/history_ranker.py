"""A ranking model that reads each user's recent items unpooled (a TorchRec EmbeddingCollection: one
embedding per id) and weighs them by their match with the candidate item (target attention, as in
DIN), beside an EmbeddingBagCollection of the user and the candidate (docs/your_model.md).

    tpurec data synth --model-module examples/history_ranker.py:build --rows 20000 --out /tmp/hist_data
    tpurec data stats /tmp/hist_data --model-module examples/history_ranker.py:build --topology cpu-1 \
        --batch-size 256 --out /tmp/hist_limits.json
    tpurec train --model-module examples/history_ranker.py:build --data /tmp/hist_data --steps 20 \
        --batch-size 256 --step compiled --limits /tmp/hist_limits.json

On a TPU (and under `--step compiled|pipelined`) the EmbeddingCollection's output is on its
fixed-shape path: each feature's `values()` padded past its ids to a fixed capacity, its lengths and
offsets on the device beside it. The forward gathers each sample's items by the offsets into a
[batch, HISTORY, DIM] block (plain torch ops, every shape fixed: no new TPU program per batch), so
it reads the same numbers on either path.

    tpurec train --model-module examples/history_ranker.py:build --data /tmp/hist_data --steps 20 \
        --batch-size 64 --emulate-tpu v5p-8 --step compiled --limits /tmp/hist_limits_v5p8.json
"""

import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
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
        history = self._history(self.sequence(sparse_features)["history"])
        weight = torch.sigmoid((history * item.unsqueeze(1)).sum(-1, keepdim=True))  # each item's match
        interest = (weight * history).sum(1)  # zero rows add nothing: no mask needed
        x = torch.cat([torch.relu(self.bottom(dense_features)), user, item, interest], dim=1)
        return self.top(x).squeeze(-1)

    @staticmethod
    def _history(jt: JaggedTensor) -> torch.Tensor:
        """[B, HISTORY, DIM]: each sample's first HISTORY items in order, zero rows past its length. No
        Python branch on a shape: TorchRec's training pipeline traces this forward with torch.fx."""
        values, lengths, offsets = jt.values(), jt.lengths(), jt.offsets()
        steps = torch.arange(HISTORY, device=offsets.device)
        padded = torch.cat([values, values.new_zeros(1, values.shape[1])])  # a zero row past every id
        rows = torch.where(steps < lengths.unsqueeze(1), offsets[:-1].unsqueeze(1) + steps, values.shape[0])
        return padded.index_select(0, rows.reshape(-1)).view(lengths.shape[0], HISTORY, values.shape[1])


def build() -> tuple[HistoryRanker, dict[str, ParameterConstraints]]:
    return HistoryRanker(), CONSTRAINTS
