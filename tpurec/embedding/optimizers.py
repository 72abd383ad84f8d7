"""Torch optimizer classes -> the fused SparseCore update, and the FusedOptimizer users checkpoint.

Users name optimizers as TorchRec's `apply_optimizer_in_backward` does: a torch optimizer class and
its kwargs. Only what the SparseCore update implements is accepted; anything else (momentum SGD,
weight decay, AMSGrad, ...) is refused with a message instead of being silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# State names follow TorchRec's fused-kernel optimizer state ("<table>.momentum1", then FBGEMM's
# name for any second state), so checkpoints line up with stock TorchRec.
STATE_NAMES = {
    "sgd": (),
    "adagrad": ("momentum1",),
    "rowwise_adagrad": ("momentum1",),
    "adam": ("momentum1", "exp_avg_sq"),
}


@dataclass(frozen=True)
class FusedOptimizerSpec:
    kind: str  # sgd | adagrad | rowwise_adagrad | adam
    lr: float
    eps: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator_value: float = 0.0

    @property
    def state_names(self) -> tuple[str, ...]:
        return STATE_NAMES[self.kind]

    def state_shape(self, name: str, rows: int, dim: int) -> tuple[int, ...]:
        if self.kind == "rowwise_adagrad":
            return (rows,)
        return (rows, dim)

    @classmethod
    def from_torch(cls, optimizer: type, kwargs: dict | None = None) -> "FusedOptimizerSpec":
        kwargs = dict(kwargs or {})
        name = getattr(optimizer, "__name__", str(optimizer))

        def take(key, default):
            return kwargs.pop(key, default)

        def refuse_nonzero(*keys):
            for key in keys:
                if kwargs.get(key) not in (None, 0, 0.0, False):
                    raise ValueError(f"{name}: {key}={kwargs[key]!r} is not supported by the fused SparseCore update")
                kwargs.pop(key, None)

        if optimizer is torch.optim.SGD:
            refuse_nonzero("momentum", "dampening", "weight_decay", "nesterov", "maximize")
            spec = cls("sgd", lr=float(take("lr", 1e-3)))
        elif optimizer is torch.optim.Adagrad:
            refuse_nonzero("lr_decay", "weight_decay", "maximize")
            spec = cls("adagrad", lr=float(take("lr", 1e-2)), eps=float(take("eps", 1e-10)),
                       initial_accumulator_value=float(take("initial_accumulator_value", 0.0)))
        elif _is_rowwise_adagrad(optimizer):
            refuse_nonzero("weight_decay", "lr_decay", "maximize")
            spec = cls("rowwise_adagrad", lr=float(take("lr", 1e-2)), eps=float(take("eps", 1e-10)),
                       initial_accumulator_value=float(take("initial_accumulator_value", 0.0)))
        elif optimizer is torch.optim.Adam:
            refuse_nonzero("weight_decay", "amsgrad", "maximize")
            b1, b2 = take("betas", (0.9, 0.999))
            spec = cls("adam", lr=float(take("lr", 1e-3)), eps=float(take("eps", 1e-8)), beta1=float(b1), beta2=float(b2))
        else:
            raise ValueError(
                f"optimizer {name} has no fused SparseCore update; use torch.optim.SGD, torch.optim.Adagrad, "
                "torchrec.optim.RowWiseAdagrad or torch.optim.Adam"
            )
        for harmless in ("foreach", "differentiable", "capturable", "fused"):
            kwargs.pop(harmless, None)
        if kwargs:
            raise ValueError(f"{name}: unsupported arguments for the fused SparseCore update: {sorted(kwargs)}")
        return spec


def spec_from_fused_params(fused_params: dict | None, table: str) -> FusedOptimizerSpec:
    """The spec from the per-table fused params TorchRec's sharder builds out of
    `apply_optimizer_in_backward(...)` (an FBGEMM `EmbOptimType` under "optimizer" plus the kwargs)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fp = dict(fused_params or {})
    kinds = {
        EmbOptimType.EXACT_SGD: "sgd",
        EmbOptimType.EXACT_ADAGRAD: "adagrad",
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad",
        EmbOptimType.ADAM: "adam",
    }
    opt = fp.get("optimizer")
    if opt not in kinds:
        raise ValueError(
            f"table {table!r}: the SparseCore kernel needs a fused optimizer; call "
            "torchrec.optim.apply_optimizer_in_backward(<SGD|Adagrad|RowWiseAdagrad|Adam>, params, kwargs) on the "
            f"unsharded model (got optimizer={opt!r})"
        )
    lr = fp.get("learning_rate", fp.get("lr", 0.01))
    betas = fp.get("betas", (fp.get("beta1", 0.9), fp.get("beta2", 0.999)))
    default_eps = 1e-8 if kinds[opt] == "adam" else 1e-10
    return FusedOptimizerSpec(kinds[opt], lr=float(lr), eps=float(fp.get("eps", default_eps)),
                              beta1=float(betas[0]), beta2=float(betas[1]),
                              initial_accumulator_value=float(fp.get("initial_accumulator_value", 0.0)))


def _is_rowwise_adagrad(optimizer: type) -> bool:
    try:
        from torchrec.optim import RowWiseAdagrad
    except ImportError:  # pragma: no cover - torchrec is a hard dependency
        return False
    return optimizer is RowWiseAdagrad
