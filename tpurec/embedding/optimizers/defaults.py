"""Default hyper-parameters the optimizer specs share, in a module that imports no torch (the registry
lists optimizer names without torch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# FBGEMM's TBE default learning rate, what TorchRec's fused kernel trains with when the fused params
# name none (fbgemm_gpu 1.8, split_table_batched_embeddings_ops_training.py,
# SplitTableBatchedEmbeddingBagsCodegen.__init__ `learning_rate: float = 0.01`); a spec built from torch
# kwargs defaults to its torch optimizer's own lr instead (the dataclass field, `default_lr`).
FBGEMM_LEARNING_RATE = 0.01


def fused_lr(fused_params: Mapping[str, Any]) -> float:
    """The learning rate in TorchRec's fused params (FBGEMM's name, or torch's), else FBGEMM's default."""
    return float(fused_params.get("learning_rate", fused_params.get("lr", FBGEMM_LEARNING_RATE)))
