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
    """All ranks' 1-D float tensors concatenated in rank order (no-op without a process group).

    `values` and `labels` may be on the device (a TPU's logits and labels): they reach the host in one
    device->host copy, counted under "eval" (tpurec.runtime.host_copies); `.numpy()` is taken of host
    tensors only (TorchTPU refuses it on a device tensor)."""
    import torch
    import torch.distributed as dist

    from tpurec.runtime import host_copies

    values, labels = values.detach().reshape(-1), labels.detach().reshape(-1)
    if values.numel() != labels.numel():
        raise ValueError(f"{values.numel()} predictions for {labels.numel()} labels")
    both = torch.stack([values.float(), labels.to(values.device).float()])
    if host_copies.on_device(values) or host_copies.on_device(labels):
        host_copies.mark_on_device(both)  # an emulated rank's device tensor (CPU data) stays "on the device"
    both = host_copies.to_host(both, "eval")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return both[0].numpy(), both[1].numpy()
    n = torch.tensor([both.shape[1]], dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(2, longest)
    padded[:, : both.shape[1]] = both
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
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
