"""A small model trained with some tables on the host tier and again all resident, for the tests.

Three tables in two stacks: t0 (1000 rows, read by two features) and t2 (2000 rows, dim 16) can go
to the host tier, t1 (300 rows, mean-pooled) stays resident beside t0 in its stack. Ids are skewed
towards low rows (uniform cubed), so a cache of 10% of the rows both hits and evicts, and a batch of
16 samples needs fewer distinct rows than the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

BATCH = 16
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=2000, feature_names=["f3"]),
]
ROWS = [1000, 1000, 300, 2000]  # per feature
WIDTH = 8 * 3 + 16  # the pooled output's columns


def batches(steps: int, seed: int = 0) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """(ids, labels) per step: 0-3 ids per bag, skewed towards low rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(ROWS) * BATCH,), generator=gen)
        values = []
        for k, rows in enumerate(ROWS):
            n = int(lengths[k * BATCH : (k + 1) * BATCH].sum())
            values.append((torch.rand(n, generator=gen) ** 3 * rows).long().clamp(max=rows - 1))
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.cat(values), lengths=lengths)
        out.append((kjt, torch.randint(0, 2, (BATCH,), generator=gen).float()))
    return out


@dataclass
class Model:
    ebc: SparseCoreEmbeddingBagCollection
    head: torch.nn.Linear
    dense: torch.optim.Optimizer


def build(optimizer: tuple, cache_params: dict | None = None, device: str | None = None) -> Model:
    """The EBC (tables drawn from seed 0) with a linear head (seed 1) and dense SGD, on `device`."""
    torch.manual_seed(0)
    ebc = SparseCoreEmbeddingBagCollection(
        TABLES, optimizer[0], dict(optimizer[1]), cache_params=cache_params, device=device
    )
    torch.manual_seed(1)
    head = torch.nn.Linear(WIDTH, 1).to(ebc.device)
    return Model(ebc, head, torch.optim.SGD(head.parameters(), lr=0.05))


def train(model: Model, data: list) -> torch.Tensor:
    """One step per batch (BCE loss, backward with the fused update, dense SGD); the losses."""
    losses = []
    for kjt, labels in data:
        logits = model.head(model.ebc(kjt).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
        model.dense.zero_grad()
        loss.backward()
        model.dense.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def tables_and_state(model: Model) -> dict[str, torch.Tensor]:
    """Every table and optimizer state tensor the model's state_dicts show, by key."""
    out = {k: v.clone() for k, v in model.ebc.state_dict().items()}
    for param, states in model.ebc.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            out[f"{param}/{name}"] = value.clone()
    return out
