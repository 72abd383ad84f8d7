"""Row-wise Adagrad: one accumulator per row, `a += mean(g*g); w -= lr * g / (sqrt(a) + eps)`.

Stands for `torchrec.optim.RowWiseAdagrad` and FBGEMM's EXACT_ROWWISE_ADAGRAD. Its update is the
Adagrad op of `adagrad.py` given a 1-D accumulator (as TorchTPU's op is), so this module only says
what differs: names, a state of one float per row, and TorchRec's row-wise checkpoint layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpurec.embedding.optimizers.adagrad import AdagradSpec


@dataclass(frozen=True)
class RowWiseAdagradSpec(AdagradSpec):
    name = "rowwise_adagrad"
    torch_optimizer_path = "torchrec.optim.RowWiseAdagrad"
    fbgemm_optim = "EXACT_ROWWISE_ADAGRAD"
    fbgemm_aliases = ("row_wise_adagrad", "rowwise_adagrad")
    refused_torch_kwargs = ("weight_decay", "lr_decay", "maximize")

    @classmethod
    def state_shape(cls, name: str, rows: int, dim: int) -> tuple[int, ...]:
        return (rows,)
