"""The sequence model of the compiled and pipelined steps' EmbeddingCollection tests
(tests/sharding/test_compiled_ec_step.py, tests/emulation/compiled_step_program.py): an EC (and with
`ebc`, an EBC beside it) under a linear layer (`SeqModel`), its batches (`sequence_batches`), and the
model sharded by tpurec's DMP with the EC on its fixed-shape output path (`sequence_dmp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

BATCH, DIM, ROWS, DENSE = 8, 8, 40, 3
TABLE_LR = 0.1
CAPACITY = 32  # max_ids_per_feature: a batch's sequences hold at most BATCH x 3 = 24 ids per feature


@dataclass
class SeqBatch:
    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor  # f0, f1: one id per sample (the EBC's)
    seq_features: KeyedJaggedTensor  # s0, s1: 0-3 ids per sample (the EC's)
    labels: torch.Tensor


def sequence_sum(jt: JaggedTensor) -> torch.Tensor:
    """[batch, dim]: each sample's embeddings summed, as a [batch, rows] 0/1 mask from the offsets times
    `values()` (fixed shapes: rows is the values' padded length in the compiled step), built where the
    offsets are: beside the values, on the device (as a model written for TorchRec on a GPU builds it)."""
    values, offsets = jt.values(), jt.offsets()
    row = torch.arange(values.shape[0], device=offsets.device)
    mask = (row >= offsets[:-1, None]) & (row < offsets[1:, None])
    return mask.to(values.dtype) @ values


class SeqModel(nn.Module):
    """An EC of tables e0, e1 (features s0, s1) and, with `ebc`, an EBC of t0, t1 (f0, f1); a linear
    layer over the summed sequences, the pooled embeddings and the dense features; (loss, logits)."""

    def __init__(self, ebc: bool, pool: str = "mask") -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

        super().__init__()
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(name=f"e{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"s{i}"])
                for i in range(2)
            ],
            device=torch.device("meta"),
        )
        self.ebc = (
            EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                    for i in range(2)
                ],
                device=torch.device("meta"),
            )
            if ebc
            else None
        )
        self.over = nn.Linear((4 if ebc else 2) * DIM + DENSE, 1)
        self.pool = pool

    def pooled(self, jt: JaggedTensor, batch: int) -> torch.Tensor:
        if self.pool == "mask":
            return sequence_sum(jt)
        # "total": every id's embedding summed, the same for each sample (padding rows add zeros): reads
        # neither lengths nor offsets
        return jt.values().sum(0, keepdim=True).expand(batch, -1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = self.ec(batch.seq_features)
        n = batch.labels.shape[0]
        x = [self.pooled(seqs["s0"], n), self.pooled(seqs["s1"], n), batch.dense_features]
        if self.ebc is not None:
            x.append(self.ebc(batch.sparse_features).values())
        logits = self.over(torch.cat(x, dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def sequence_batches(n: int, longest: int = 3, seed: int = 0) -> list[SeqBatch]:
    """Sequences of 0..longest ids (empty ones too, repeated ids), a label that depends on the ids."""
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(ROWS, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(n):
        lengths = torch.randint(0, longest + 1, (2 * BATCH,), generator=gen)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        seq = KeyedJaggedTensor(keys=["s0", "s1"], values=ids, lengths=lengths)
        per_sample = torch.zeros(BATCH).index_add_(
            0, torch.repeat_interleave(torch.arange(2 * BATCH) % BATCH, lengths), score[ids]
        )
        sparse = KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.randint(0, ROWS, (2 * BATCH,), generator=gen),
            lengths=torch.ones(2 * BATCH, dtype=torch.long),
        )
        dense = torch.randn(BATCH, DENSE, generator=gen)
        out.append(SeqBatch(dense, sparse, seq, (per_sample > 0).float()))
    return out


def sequence_dmp(
    ebc: bool, fixed: bool = True, types: dict[str, str] | None = None, device: str = "cpu", pool: str = "mask"
) -> Any:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.sharding.ec_sharder import SparseCoreECSharder
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    torch.manual_seed(0)
    model = SeqModel(ebc, pool)
    tables = [p for m in (model.ec, model.ebc) if m is not None for p in m.parameters()]
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": TABLE_LR})
    sharders: list[Any] = [
        SparseCoreECSharder(fixed_limits=True, max_ids_per_feature=CAPACITY, max_ids_per_partition=64)
    ]
    if ebc:
        sharders.append(SparseCoreEBCSharder(max_ids_per_partition=64))
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in (types or {}).items()} or None
    dmp = tpurec.DistributedModelParallel(
        model, device=device, batch_size=BATCH, sharders=sharders, constraints=constraints
    )
    if not fixed:  # the same kernels, TorchRec's own sequence output dist (values unpadded)
        dmp.module.ec._fixed_output = None
    return dmp
