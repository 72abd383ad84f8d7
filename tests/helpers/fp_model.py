"""A FeatureProcessedEmbeddingBagCollection (position-weighted) inside a model whose output is a tensor
(`FPModel`, tables TABLES): the FP-EBC case of tests/sharding/test_fpebc_dmp.py and the step tests."""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

TABLES = [("t0", 40, 8, "f0"), ("t1", 30, 16, "f1")]
MAX_LENGTH = 4  # ids per sample at most: the position weights' length


class FPModel(nn.Module):
    """The FP-EBC inside a model whose output is a tensor, as a ranking model's is: DMP's DDP then
    all-reduces the position weights' gradients. (With the FP-EBC itself as the model, its KeyedTensor
    output gives DDP's static graph no tensor to hook, and in stock TorchRec as in tpurec each rank
    keeps its own gradient: under row-wise sharding a part of it.)"""

    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f]) for n, r, d, f in TABLES
        ]
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
        self.fp = FeatureProcessedEmbeddingBagCollection(
            ebc, {f: PositionWeightedModule(MAX_LENGTH) for *_, f in TABLES}
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.fp(features).values()
