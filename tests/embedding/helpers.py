"""Random ragged batches and table configs shared by the embedding tests (the sequence ones: `seq_tables`,
`seq_batch`)."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def make_tables(pooling=PoolingType.SUM) -> list[EmbeddingBagConfig]:
    # Two features share t1 (as in EBC); t2 has another dim, t3 a vocabulary smaller than P*8.
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=37, feature_names=["f1", "f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=50, feature_names=["f3"], pooling=pooling),
        EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=5, feature_names=["f4"], pooling=pooling),
    ]


def random_kjt(
    tables, batch: int, gen: torch.Generator, max_len: int = 4, weighted: bool = False, hot_ids: bool = False
) -> KeyedJaggedTensor:
    """Ragged batch with empty bags and repeated ids (hot_ids: ids drawn from a few rows)."""
    keys, rows = [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            rows.append(t.num_embeddings)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
    parts = []
    for k, r in enumerate(rows):
        n = int(lengths[k * batch : (k + 1) * batch].sum())
        hi = min(r, 3) if hot_ids else r
        parts.append(torch.randint(0, hi, (n,), generator=gen))
    values = torch.cat(parts)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def assert_within_fp16_steps(got, want, steps: int = 2, rare: float = 0.01) -> None:
    """got and want (fp16 values) differ by at most `steps` fp16 spacings at their magnitude (2^-24
    below the normal range), on at most a fraction `rare` of the elements.

    For FP16 tables trained by two kernels whose float32 update may differ in its last bit: one fp16
    step where that bit decides a rounding, which reads as two if the weight then moved below a
    power of two."""
    import torch

    got, want = got.float(), want.float()
    mag = torch.maximum(got.abs(), want.abs()).clamp(min=2.0**-14)
    spacing = torch.exp2(torch.floor(torch.log2(mag)) - 10)
    diff = (got - want).abs()
    worst = float((diff / spacing).max()) if diff.numel() else 0.0
    assert worst <= steps, f"fp16 values differ by {worst} steps (at most {steps} allowed)"
    differing = int((diff > 0).sum())
    assert differing <= rare * diff.numel(), f"{differing} of {diff.numel()} fp16 values differ"


def fused_optimizers() -> dict:
    """The four fused optimizers with the hyper-parameters the kernel tests train with."""
    from torchrec.optim import RowWiseAdagrad

    return {
        "sgd": (torch.optim.SGD, {"lr": 0.1}),
        "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-6}),
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6}),
        "adam": (torch.optim.Adam, {"lr": 0.01, "eps": 1e-6}),
    }


def seq_tables(dtype=DataType.FP32):
    # t1 feeds two features; f1 also feeds t2 (a shared feature: outputs "f1@t1", "f1@t2");
    # t3 is smaller than its partitions x 8.
    return [
        EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=37, feature_names=["f1", "f2"], data_type=dtype),
        EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=50, feature_names=["f3", "f1"], data_type=dtype),
        EmbeddingConfig(name="t3", embedding_dim=8, num_embeddings=5, feature_names=["f4"], data_type=dtype),
    ]


def seq_batch(gen, bsz=6, hot=False, dtype=torch.int64, max_len=5):
    # random_kjt reads tables' feature names once each: give it one entry per distinct input feature.
    features = [
        EmbeddingConfig(name=f, embedding_dim=8, num_embeddings=n, feature_names=[f])
        for f, n in (("f4", 5), ("f1", 37), ("f3", 50), ("f2", 37))
    ]
    kjt = random_kjt(features, bsz, gen, max_len=max_len, hot_ids=hot)  # keys deliberately not in table order
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(dtype), lengths=kjt.lengths())
