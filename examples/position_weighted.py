"""A ranking model whose history feature is weighted by position: TorchRec's
FeatureProcessedEmbeddingBagCollection with a `PositionWeightedModule` (one trainable weight per
position, multiplying each id's embedding before the bag is pooled), beside a plain
EmbeddingBagCollection of the user (docs/your_model.md).

    tpurec data synth --model-module examples/position_weighted.py:build --rows 20000 --out /tmp/pw_data
    tpurec data stats /tmp/pw_data --model-module examples/position_weighted.py:build --topology cpu-1 \
        --batch-size 256 --out /tmp/pw_limits.json
    tpurec train --model-module examples/position_weighted.py:build --data /tmp/pw_data --steps 20 \
        --batch-size 256 --step compiled --limits /tmp/pw_limits.json

`--step compiled` trains the position weights inside its one graph; `--step pipelined` refuses the
model (its tables would be looked up a step ahead of the position weights' update).
"""

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

NUM_DENSE = 4
HISTORY = 6  # ids per sample of the history (`data synth` writes this many: the pooling factor below)
USERS = [EmbeddingBagConfig(name="t_users", embedding_dim=8, num_embeddings=5000, feature_names=["user_id"])]
ITEMS = [EmbeddingBagConfig(name="t_history", embedding_dim=8, num_embeddings=3000, feature_names=["history"])]
CONSTRAINTS = {"t_history": ParameterConstraints(pooling_factors=[float(HISTORY)])}


class PositionWeightedRanker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_in_features = NUM_DENSE
        self.users = EmbeddingBagCollection(tables=USERS, device=torch.device("meta"))
        # a weighted EBC: the feature processor gives each id its position's weight
        history = EmbeddingBagCollection(tables=ITEMS, is_weighted=True, device=torch.device("meta"))
        self.history = FeatureProcessedEmbeddingBagCollection(
            history, {"history": PositionWeightedModule(max_feature_length=HISTORY)}
        )
        self.top = torch.nn.Sequential(torch.nn.Linear(NUM_DENSE + 16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        user = self.users(sparse_features).values()
        history = self.history(sparse_features).values()
        return self.top(torch.cat([dense_features, user, history], dim=1)).squeeze(-1)


def build() -> tuple[PositionWeightedRanker, dict[str, ParameterConstraints]]:
    return PositionWeightedRanker(), CONSTRAINTS
