"""Optimizer options the fused update cannot honour are refused by name under DMP, never dropped
(weight decay FBGEMM applies is honoured: tests/sharding/test_weight_decay_dmp.py)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec


@pytest.mark.parametrize(
    "optimizer, kwargs, option",
    [
        (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}, "amsgrad=True"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 1e-4}, "weight_decay=0.0001 with weight_decay_mode NONE"),
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 1e-4}, "weight_decay=0.0001"),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.5}, "lr_decay=0.5"),
    ],
)
def test_an_option_the_fused_update_cannot_honour_is_refused_by_name(optimizer, kwargs, option):
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(optimizer, ebc.parameters(), kwargs)
    with pytest.raises(ValueError, match=rf"table 't0': .*{option} is not supported .*refused, not ignored"):
        tpurec.DistributedModelParallel(ebc, device="cpu")
