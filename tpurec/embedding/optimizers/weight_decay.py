"""Weight decay of the fused update, as FBGEMM's fused kernels define it, on the rows in the batch.

What FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` does with `weight_decay` / `weight_decay_mode`
(fbgemm_gpu/codegen/genscript/optimizers.py; TorchRec passes both through as fused params):

* EXACT_SGD, EXACT_ADAGRAD: take no weight decay at all (their kernels have no such argument).
* EXACT_ROWWISE_ADAGRAD: mode NONE applies none; L2 adds weight_decay * w to the row's gradient
  for the accumulator and scales w by 1 - multiplier * weight_decay; DECOUPLE scales w by
  1 - lr * weight_decay (multiplier = lr / (sqrt(accumulator) + eps)); COUNTER and COWCLIP keep
  per-row counters; DECOUPLE_GLOBAL (GPU) catches up the decay of the steps a row missed.
* ADAM: decoupled, AdamW-style, whatever the mode: w -= lr * (adam step + weight_decay * w).
* LAMB, LARS_SGD, PARTIAL_ROWWISE_ADAM/LAMB (GPU only; tpurec has none of them, refused as
  optimizers): weight_decay * w added to the update direction before the trust ratio (LAMB) or
  to the gradient (LARS), whatever the mode.

On CPU FBGEMM has kernels for EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD only ("Optimizer
adam is not supported in CPU mode"), and its row-wise Adagrad applies the decay only on its generic
path: an FP32 table read by one feature takes fbgemm's SparseAdaGrad kernel with weight_decay=0
(embedding_backward_split_cpu_template.cpp), silently.

tpurec honours the L2 and decoupled forms and refuses the rest by name (never trains without an
option it was given). Both act on the rows of the batch only, as FBGEMM's do, and reach the fused op
as its TorchTPU form allows (it has no weight-decay argument), through the update layout in which
each row has one slot holding its whole gradient (`tpurec.embedding.multipass`):

* L2: the slot's gradient becomes g + weight_decay * w (the row gathered on the device), so the op
  sees FBGEMM's L2 gradient: accumulator from it, and w - m (g + wd w) = (1 - m wd) w - m g.
* decoupled: the rows are scaled by 1 - lr * weight_decay before the op, as FBGEMM's
  `correction * w - multiplier * g` (Adam: w - lr wd w - step).

The CPU reference needs no layout: it has each row and its gradient at hand, so there the decay
applies to them and the spec updates the rows (`OptimizerSpec.update_rows`).
"""

from __future__ import annotations

import torch

from tpurec.errors import UserError

MODES = ("NONE", "L2", "DECOUPLE", "COUNTER", "COWCLIP", "DECOUPLE_GLOBAL")

# Modes that mean more than a decay: state per row that the fused update does not keep.
_NEEDS_ROW_STATE = {
    "COUNTER": "counter-based regularization keeps per-row counters and iterations",
    "COWCLIP": "CowClip keeps per-row counters and iterations",
    "DECOUPLE_GLOBAL": "global weight decay keeps each row's last step",
}


def mode_name(value) -> str:
    """FBGEMM's name of a weight_decay_mode given as its `WeightDecayMode`, int value or name."""
    if value is None:
        return "NONE"
    name = getattr(value, "name", None)
    if isinstance(value, int) and not isinstance(value, bool) and name is None and 0 <= value < len(MODES):
        return MODES[value]  # FBGEMM's WeightDecayMode values follow MODES' order
    text = str(name if name is not None else value).upper()
    if text in MODES:
        return text
    raise UserError(f"weight_decay_mode={value!r} is not one of FBGEMM's WeightDecayMode {'/'.join(MODES)}")


def resolve(cls, weight_decay: float, mode) -> str | None:
    """The mode tpurec applies for optimizer class `cls` ("L2", "DECOUPLE"; None: no decay), or a
    one-line UserError naming the optimizer, the option and what is supported."""
    label = cls.torch_class_name()
    honoured = cls.weight_decay_modes
    try:
        name = mode_name(mode)
    except UserError as e:
        raise UserError(f"{label}: {e}") from None
    supported = "supported: weight_decay_mode " + " or ".join(honoured) if honoured else "leave it out"
    if name in _NEEDS_ROW_STATE:
        raise UserError(
            f"{label}: weight_decay_mode={name} is not supported by the fused SparseCore update "
            f"({_NEEDS_ROW_STATE[name]}, which tpurec does not keep); {supported}"
        )
    if not weight_decay:
        return None
    if name in honoured:
        return honoured[name]
    option = f"weight_decay={weight_decay!r}"
    if not honoured:
        why = f"FBGEMM's {cls.fbgemm_optim} has no weight decay (stock TorchRec trains without it)"
    elif name == "NONE":
        why = f"FBGEMM's {cls.fbgemm_optim} applies none in mode NONE (stock TorchRec trains without it)"
        option += " with weight_decay_mode NONE"
    else:
        why = f"FBGEMM's {cls.fbgemm_optim} {cls.weight_decay_note}"
        option += f" with weight_decay_mode={name}"
    raise UserError(f"{label}: {option} is not supported by the fused SparseCore update: {why}; {supported}")


def fbgemm_mode(name: str):
    """FBGEMM's `WeightDecayMode` member of a mode name (what TorchRec's sharder passes on)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return WeightDecayMode[name]


def decay_slots(
    spec, table: torch.Tensor, grad: torch.Tensor, slot_ids: torch.Tensor, lr: float, num_partitions: int
) -> torch.Tensor:
    """`decay_rows` for one update pass in the one-slot-per-row layout (the TPU path). slot_ids: [slots]
    the SparseCore id of each slot's row (empty slots repeat a row of the pass: their gradient is
    never read, and a decoupled scale writes that row's one new value several times); an empty
    tensor when the pass has no rows."""
    if spec.weight_decay_mode is None or slot_ids.numel() == 0:
        return grad
    # SparseCore id v lives at physical row (v mod P) * C + v div P (layout.py); P partitions of C rows.
    parts = num_partitions
    rows = (slot_ids % parts) * (table.shape[0] // parts) + slot_ids // parts
    return decay_rows(spec, table, grad, rows, lr)


@torch.no_grad()
def decay_rows(spec, table: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor, lr: float) -> torch.Tensor:
    """Apply `spec`'s weight decay before its update of physical `rows` (grad: their gradients, one
    row each); returns the gradient for the update. L2 adds wd * w to it; decoupled scales the rows."""
    if spec.weight_decay_mode is None or rows.numel() == 0:
        return grad
    w = table.index_select(0, rows).to(torch.float32)
    if spec.weight_decay_mode == "L2":
        return grad.add(w, alpha=spec.weight_decay)
    # The factor as a device tensor: the learning rate may change every step (schedulers), and
    # TorchTPU compiles a Python float into the program (as for the ops' learning rates, base.tpu_scalar).
    factor = torch.tensor(1.0 - lr * spec.weight_decay, dtype=torch.float32, device=table.device)
    table.index_copy_(0, rows, w.mul_(factor).to(table.dtype))
    return grad
