"""Evaluation metrics over the union of all ranks' predictions: AUC, NE, log loss, accuracy.

Each rank holds the logits of its share of the eval split; they are all-gathered (padded to the
longest rank, since shares may differ by a row group) and every rank computes the same numbers.
AUC is rank-based, so it must see all predictions at once; a mean of per-rank AUCs would be wrong.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def gather(values: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """All ranks' 1-D float tensors concatenated in rank order (no-op without a process group)."""
    import torch
    import torch.distributed as dist

    values, labels = values.detach().float().reshape(-1), labels.detach().float().reshape(-1)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.numpy(), labels.numpy()
    n = torch.tensor([values.numel()], dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    both = torch.zeros(2, longest)
    both[0, : values.numel()], both[1, : labels.numel()] = values, labels
    parts = [torch.zeros_like(both) for _ in sizes]
    dist.all_gather(parts, both)
    v = torch.cat([p[0, : int(s.item())] for p, s in zip(parts, sizes)])
    y = torch.cat([p[1, : int(s.item())] for p, s in zip(parts, sizes)])
    return v.numpy(), y.numpy()


def compute(logits: np.ndarray, labels: np.ndarray) -> dict:
    """auc, ne (log loss / entropy of the label rate), logloss, accuracy (threshold 0.5), rows."""
    from tpurec.data.synth import auc  # torchmetrics' binary_auroc, shared with the synthetic oracle

    logits = logits.astype(np.float64)
    y = labels.astype(np.float64)
    # log loss from logits, numerically stable: log(1 + e^-|z|) + max(z, 0) - y z
    logloss = float(np.mean(np.logaddexp(0.0, logits) - y * logits)) if len(y) else float("nan")
    p = y.mean() if len(y) else float("nan")
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else float("nan")
    return {
        "auc": auc(logits, y),
        "ne": logloss / entropy if entropy == entropy and entropy > 0 else float("nan"),
        "logloss": logloss,
        "accuracy": float(np.mean((logits > 0) == (y > 0.5))) if len(y) else float("nan"),
        "rows": int(len(y)),
    }
