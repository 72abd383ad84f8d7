"""The direct CPU step: lookup and fused update straight from the KJT, when the SparseCore layout
would change nothing.

With no id limits (none given, none fixed) nothing is ever dropped or split into passes, so the
SparseCore semantics are exactly TBE's: each bag sums gain * row, and each touched row takes its
summed gradient once through the optimizer. Building the layout (a sort of every id into
(SparseCore, partition) segments, and reading it back in both directions) is then pure overhead on
CPU; this path pools the bags from the KJT's ids and updates the rows grouped by a dense row map,
with no sort (`direct_kernels.py`). The results equal the layout path's up to the order of float32
additions (tests/embedding/test_direct_step.py).

The layout path still runs whenever it is the thing being exercised or could differ: fixed or given
limits (a TPU, `table_limits`, the dry run), the TorchTPU stand-in (the ops' CPU kernels replaced),
meta/fake tensors or tracing, tables stored padded or in FP16/BF16, `TPUREC_NO_DIRECT=1`, and any
optimizer option this module does not know (it refuses rather than ignores: a spec field it does not
list must be off, i.e. 0, False or None). `SparseCoreKernel.preprocess` always builds the layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np
import torch

# The spec fields the update loops below implement, per optimizer name; any other field must be off.
_IMPLEMENTED = {
    "sgd": {"lr"},
    "adagrad": {"lr", "eps", "initial_accumulator_value"},
    "rowwise_adagrad": {"lr", "eps", "initial_accumulator_value"},
    "adam": {"lr", "eps", "beta1", "beta2"},
}


def _available() -> bool:
    if os.environ.get("TPUREC_NO_DIRECT", "") not in ("", "0"):
        return False
    from tpurec.embedding import csr_build

    return csr_build.available()  # numba present and not switched off (TPUREC_NO_NUMBA)


def applies(kernel) -> bool:
    """Whether `kernel`'s next step may take the direct path (see the module docstring)."""
    from tpurec.embedding.kernel import _writes_final_layout

    if not kernel.stacks or kernel.fixed_limits:
        return False
    if kernel.max_ids_per_partition is not None or kernel.max_unique_ids_per_partition is not None:
        return False
    spec = kernel.optimizer
    known = _IMPLEMENTED.get(spec.name)
    if known is None:
        return False
    for f in fields(spec):
        if f.name not in known and getattr(spec, f.name) not in (None, 0, 0.0, False):
            return False
    for i, plan in enumerate(kernel.stacks):
        lay, weight = plan.layout, kernel.stack_weight(i)
        if lay.dtype != torch.float32 or lay.storage_dim != lay.dim or not _writes_final_layout(weight):
            return False
        if not weight.is_contiguous():
            return False
        for s in spec.state_names:
            st = kernel.stack_state(i, s)
            if st.dtype != torch.float32 or not st.is_contiguous() or type(st) is not torch.Tensor:
                return False
    return _available()


def lookup(kernel, parts: list, batch: int) -> torch.Tensor | None:
    """Pooled [batch, sum of dims] in feature order with the fused update in backward, from
    `SparseCoreKernel._stack_arrays`'s per-stack (values, lengths, weights); None when an id is out
    of its table's range (the layout path then raises its message) or a sort key would not fit."""
    from tpurec.embedding import direct_kernels as dk
    from tpurec.embedding.kernel import _trigger

    grad = torch.is_grad_enabled()
    inputs = []
    for i, (values, lengths, weights) in enumerate(parts):
        offsets, rows, mean = kernel._stack_tensors[i]
        ns, n = offsets.numel(), values.numel()
        mean_np = mean.numpy() if mean is not None else np.zeros(ns, np.bool_)
        want_gains = weights is not None or mean is not None
        key_bits = max(int((n if want_gains else batch * ns) - 1).bit_length(), 1)
        tables = _table_runs(kernel, i)
        row_bits = max((rows_t - 1).bit_length() for _, _, _, rows_t in tables)
        if row_bits + key_bits > 63:
            return None
        # uint32 keys sort about twice as fast as int64 ones
        keys = np.empty(n if grad else 0, np.uint32 if row_bits + key_bits <= 32 else np.int64)
        w = weights.to(torch.float32).contiguous().numpy() if weights is not None else np.empty(1, np.float32)
        ids, boff, gains, bag_of, bad = dk.bags(
            values.numpy(), lengths.numpy(), w, weights is not None, mean_np, offsets.numpy(), rows.numpy(),
            batch, want_gains, grad, key_bits, keys,
        )  # fmt: skip
        if bad >= 0:
            return None
        # each table's keys: the ids of its feature slots, one run of the input
        ends = [0] + (lengths.view(ns, batch).sum(1).cumsum(0).tolist() if batch else [0] * ns)
        segments = [(ends[lo], ends[hi], base) for lo, hi, base, _ in tables]
        inputs.append(_Bags(*(torch.from_numpy(x) for x in (ids, boff, gains)), keys, key_bits, segments, bag_of, ns))
    trigger = _trigger() if grad else None
    outs = [_DirectLookup.apply(trigger, kernel, i, b, batch) for i, b in enumerate(inputs)]
    return kernel._feature_order_output(outs)


def _table_runs(kernel, i: int) -> list[tuple[int, int, int, int]]:
    """Stack i's tables as (first slot, past the last slot, first stack row, rows): a table's
    features are consecutive slots (kernel order), and its rows are one run of the stack's."""
    cache = kernel.__dict__.setdefault("_direct_table_runs", {})
    if i not in cache:
        plan, runs = kernel.stacks[i], []
        for k, (_, name) in enumerate(plan.features):
            if runs and runs[-1][4] == name:
                runs[-1][1] = k + 1
            else:
                runs.append([k, k + 1, plan.layout.table(name).offset, kernel._table[name].num_embeddings, name])
        cache[i] = [tuple(r[:4]) for r in runs]
    return cache[i]


@dataclass
class _Bags:
    """One stack's batch in batch-major bags (direct_kernels.bags) and its backward's sort keys."""

    ids: torch.Tensor  # int64 stacked rows
    offsets: torch.Tensor  # int64 [bags + 1]
    gains: torch.Tensor  # float32 per id, or empty (all 1)
    keys: np.ndarray  # uint32 or int64 per id in input order (empty without backward)
    key_bits: int
    segments: list  # (first key, past the last, first stack row) of each table
    bag_of: np.ndarray  # int32 bag per batch-major position (with gains), else empty
    slots: int


class _DirectLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trigger, kernel, i: int, bags: _Bags, batch: int):
        ctx.kernel, ctx.i, ctx.bags = kernel, i, bags
        weight = kernel.stack_weight(i)
        dim = weight.shape[1]
        if bags.ids.numel() == 0:  # no ids (batch 0 or all bags empty): embedding_bag wants some
            return torch.zeros(batch, bags.slots * dim)
        out = torch.nn.functional.embedding_bag(
            bags.ids,
            weight,
            bags.offsets,
            mode="sum",
            per_sample_weights=bags.gains if bags.gains.numel() else None,
            include_last_offset=True,
        )
        return out.view(batch, bags.slots * dim)

    @staticmethod
    @torch.no_grad()
    def backward(ctx, grad):
        from tpurec.embedding import direct_kernels as dk

        kernel, i, bags = ctx.kernel, ctx.i, ctx.bags
        lr = kernel.current_lr()
        for hook in kernel.pre_update_hooks:
            hook()
        kernel._steps[i] += 1
        spec, weight = kernel.optimizer, kernel.stack_weight(i)
        g = grad.to(torch.float32).contiguous().view(-1, weight.shape[1]).numpy()
        states = [kernel.stack_state(i, s).numpy() for s in spec.state_names]
        f32 = np.float32
        if spec.name == "adam":
            from tpurec.embedding.optimizers.adam import alpha_t

            b1, b2 = spec.beta1, spec.beta2
            a = alpha_t(lr, b1, b2, kernel._steps[i])
        for lo, hi, base in bags.segments:
            keys = bags.keys[lo:hi]
            keys.sort()  # numpy's sort (AVX-512 on x86): each row's entries adjacent, rows increasing
            head = (keys, bags.key_bits, base, bags.gains.numpy(), bags.bag_of, g, weight.numpy(), *states)
            if spec.name == "sgd":
                dk.update_sgd(*head, f32(-lr))
            elif spec.name == "adagrad":
                dk.update_adagrad(*head, f32(-lr), f32(spec.eps))
            elif spec.name == "rowwise_adagrad":
                dk.update_rowwise_adagrad(*head, f32(-lr), f32(spec.eps))
            else:  # adam (applies() admits no other)
                dk.update_adam(*head, f32(-a), f32(b1), f32(1 - b1), f32(b2), f32(1 - b2), f32(spec.eps))
        return None, None, None, None, None
