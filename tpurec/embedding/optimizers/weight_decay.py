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
as its TorchTPU form allows (it has no weight-decay argument), with every device op of a shape fixed
by the id limits, so that a TPU compiles nothing after the first steps (`DecayInput`):

* decoupled: the batch's distinct rows are scaled by 1 - lr * weight_decay before the ordinary
  update, as FBGEMM's `correction * w - multiplier * g` (Adam: w - lr wd w - step): one gather and
  one write of `max_rows` rows (the most a batch within its limits touches), padded by repeating a
  row (which writes its one new value again);
* L2: the update op gets the batch's entries plus one entry per distinct row, in `extra` samples
  added to each SparseCore slice (gain 1), whose activation gradient is weight_decay * w (the row
  gathered on the device): the op sums FBGEMM's L2 gradient g + wd w (accumulator from it, and
  w - m (g + wd w) = (1 - m wd) w - m g). The extra entry of a row goes to a slice where the row
  already is, so each (slice, partition) gets at most its unique ids more entries: the update's
  limits are (max ids + max unique ids, max unique ids), and `extra` = partitions x max unique ids.

A batch over its limits runs in update passes in which each row has one slot holding its whole
gradient (`tpurec.embedding.multipass`); the decay takes the same shapes there: L2, each pass with
its rows' extra entries (every pass fits the limits, so the same update program); decoupled, the
batch's rows scaled once before the passes, in chunks of `max_rows`. The CPU reference's passes
decay each pass's slots (`decay_slots`).

The CPU reference needs no layout: it has each row and its gradient at hand, so there the decay
applies to them and the spec updates the rows (`OptimizerSpec.update_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from tpurec.embedding.preprocess import SparseCoreInput, preprocess
from tpurec.embedding.step_scalars import tpu_scalar
from tpurec.errors import UserError

# `spec` arguments are OptimizerSpecs, typed Any: optimizers/base.py imports this module.

MODES = ("NONE", "L2", "DECOUPLE", "COUNTER", "COWCLIP", "DECOUPLE_GLOBAL")

# Modes that mean more than a decay: state per row that the fused update does not keep.
_NEEDS_ROW_STATE = {
    "COUNTER": "counter-based regularization keeps per-row counters and iterations",
    "COWCLIP": "CowClip keeps per-row counters and iterations",
    "DECOUPLE_GLOBAL": "global weight decay keeps each row's last step",
}


def mode_name(value: Any) -> str:
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


def resolve(cls: Any, weight_decay: float, mode: Any) -> str | None:
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


def fbgemm_mode(name: str) -> Any:
    """FBGEMM's `WeightDecayMode` member of a mode name (what TorchRec's sharder passes on)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return WeightDecayMode[name]


def decay_slots(
    spec: Any, table: torch.Tensor, grad: torch.Tensor, slot_ids: torch.Tensor, lr: float, num_partitions: int
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
def decay_rows(spec: Any, table: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor, lr: float) -> torch.Tensor:
    """Apply `spec`'s weight decay before its update of physical `rows` (grad: their gradients, one
    row each); returns the gradient for the update. L2 adds wd * w to it; decoupled scales the rows."""
    if spec.weight_decay_mode is None or rows.numel() == 0:
        return grad
    w = table.index_select(0, rows).to(torch.float32)
    if spec.weight_decay_mode == "L2":
        return grad.add(w, alpha=spec.weight_decay)
    # The factor as a device tensor: the learning rate may change every step (schedulers), and
    # TorchTPU compiles a Python float into the program (as for the ops' learning rates, step_scalars.tpu_scalar;
    # a compiled step's feed entry, step_scalars.py).
    factor = tpu_scalar(1.0 - lr * spec.weight_decay, table, "decay_factor")
    table.index_copy_(0, rows, w.mul_(factor).to(table.dtype))
    return grad


@dataclass
class DecayInput:
    """A stack's input within its id limits when its update decays weights on the TPU path: the
    batch's own lookup input and what the decay adds, each tensor of a shape fixed by the limits.

    decoupled: `update` is `lookup`, `rows` the batch's distinct physical rows in chunks of
    `max_rows` (a chunk's padding repeats its first row). L2: `update` holds the batch's entries and
    one more per distinct row in `extra` samples after each SparseCore slice's own; `rows` is one
    [SparseCores x extra] tensor, each extra sample's physical row (unused ones: row 0)."""

    lookup: SparseCoreInput
    update: SparseCoreInput
    rows: list[torch.Tensor]
    extra: int = 0

    @property
    def device_batch_size(self) -> int:
        return self.lookup.device_batch_size

    def to(self, device: torch.device) -> DecayInput:
        return replace(
            self, lookup=self.lookup.to(device), update=self.update.to(device), rows=[r.to(device) for r in self.rows]
        )


def decay_input(
    spec: Any,
    csr: SparseCoreInput,
    ids: torch.Tensor,
    samples: torch.Tensor,
    gains: torch.Tensor,
    *,
    num_partitions: int,
    rows_per_partition: int,
    table_name: str,
) -> DecayInput:
    """The `DecayInput` of a batch within its limits (host side). ids: the entries' SparseCore ids,
    samples: their device samples, gains; csr: the batch's input at the stack's limits."""
    num_sc, parts = csr.num_sc_per_device, num_partitions
    max_uniq = csr.max_unique_ids_per_partition
    num_rows = parts * rows_per_partition
    ids_np = ids.numpy().astype(np.int64, copy=False)
    uniq, first = np.unique(ids_np, return_index=True)
    physical = (uniq % parts) * rows_per_partition + uniq // parts
    if spec.weight_decay_mode != "L2":
        # Distinct rows of a batch within its limits: at most max unique ids per (slice, partition).
        max_rows = min(num_sc * parts * max_uniq, num_rows)
        chunks = [_repeat_first(physical[k : k + max_rows], max_rows) for k in range(0, len(physical), max_rows)]
        return DecayInput(csr, csr, chunks)
    per = csr.device_batch_size // num_sc
    extra = min(parts * max_uniq, num_rows)
    smp = samples.numpy().astype(np.int64, copy=False)
    slice_ = smp // per
    row_slice = slice_[first]  # each row's extra entry joins a slice (and so a segment) it is in
    order = np.argsort(row_slice, kind="stable")
    rank = np.empty(len(uniq), dtype=np.int64)
    counts = np.bincount(row_slice, minlength=num_sc)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank[order] = np.arange(len(uniq)) - np.repeat(starts, counts)
    if len(uniq) and int(rank.max()) >= extra:  # not for a batch within its limits
        raise AssertionError(f"{table_name}: {int(rank.max()) + 1} rows in one slice, over {extra}")
    width = per + extra
    slot_rows = np.zeros(num_sc * extra, dtype=np.int64)
    slot_rows[row_slice * extra + rank] = physical
    update, _ = preprocess(
        torch.from_numpy(np.concatenate([ids_np, uniq])),
        torch.from_numpy(np.concatenate([slice_ * width + smp % per, row_slice * width + per + rank])),
        torch.cat([gains.to(torch.float32), torch.ones(len(uniq), dtype=torch.float32)]),
        device_batch_size=num_sc * width,
        num_sc_per_device=num_sc,
        max_ids_per_partition=csr.max_ids_per_partition + max_uniq,
        max_unique_ids_per_partition=max_uniq,
        table_name=table_name,
    )
    return DecayInput(csr, update, [torch.from_numpy(slot_rows)], extra)


def _repeat_first(rows: np.ndarray, size: int) -> torch.Tensor:
    out = np.full(size, rows[0], dtype=np.int64)
    out[: len(rows)] = rows
    return torch.from_numpy(out)


@torch.no_grad()
def apply_decay(
    spec: Any, table: torch.Tensor, grad: torch.Tensor, decay: DecayInput, lr: float
) -> tuple[SparseCoreInput, torch.Tensor]:
    """The device side of `decay`: scales its rows (decoupled) or appends their L2 gradient rows;
    returns the input and the [device batch, width] gradient of the fused update."""
    if spec.weight_decay_mode == "L2":
        (rows,) = decay.rows
        num_sc, width = decay.lookup.num_sc_per_device, grad.shape[1]
        term = table.index_select(0, rows).to(torch.float32).mul_(spec.weight_decay)
        both = torch.cat([grad.view(num_sc, -1, width), term.view(num_sc, decay.extra, width)], dim=1)
        return decay.update, both.view(-1, width)
    if not decay.rows:
        return decay.update, grad
    factor = tpu_scalar(1.0 - lr * spec.weight_decay, table, "decay_factor")
    for rows in decay.rows:
        table.index_copy_(0, rows, table.index_select(0, rows).to(torch.float32).mul_(factor).to(table.dtype))
    return decay.update, grad
