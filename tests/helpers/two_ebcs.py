"""A model of two EmbeddingBagCollections (`TwoEBCs`: items t0, t1 of f0, f1; users t2, t3 of f2, f3) and
its batch with the users' ids in a KJT field of their own (`TwoFields`): the several-EBC case of the
compiled and pipelined steps (tests/sharding/test_several_ebcs_step.py, tests/emulation/compiled_step_program.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding.dlrm_case import DENSE, DIM, ROWS


@dataclass
class TwoFields:
    """A batch whose ids come in two KJTs: f0, f1 in `sparse_features`, f2, f3 in `user_features`."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    user_features: KeyedJaggedTensor
    labels: torch.Tensor


class TwoEBCs(nn.Module):
    """Two EBCs (tables t0, t1 of f0, f1; t2, t3 of f2, f3) and a linear model over their pooled
    embeddings and the dense features; forward returns (loss, logits) as TorchRec's DLRMTrain does."""

    def __init__(self, fields: str) -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()

        def ebc(first: int) -> EmbeddingBagCollection:
            tables = [
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                for i in (first, first + 1)
            ]
            return EmbeddingBagCollection(tables, device=torch.device("meta"))

        self.fields = fields
        self.items, self.users = ebc(0), ebc(2)
        self.dense = nn.Linear(DENSE, DIM)
        self.over = nn.Linear(5 * DIM, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        users = batch.sparse_features if self.fields == "shared" else batch.user_features
        x = torch.cat(
            [self.dense(batch.dense_features), self.items(batch.sparse_features).values(), self.users(users).values()],
            dim=1,
        )
        logits = self.over(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits
