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
limits (a TPU, `id_limits`, the dry run), the TorchTPU stand-in (the ops' CPU kernels replaced),
meta/fake tensors or tracing, tables stored padded or in FP16/BF16, `TPUREC_NO_DIRECT=1`, and any
optimizer option its spec's direct step does not implement (refused rather than ignored: a spec field
not in its `direct_fields` must be off, i.e. 0, False or None). Each optimizer's update loop is a method
of its spec (`direct_update`, in `optimizers/`), weight decay included (L2 and decoupled, on the
touched rows before their update, as `optimizers/weight_decay.py`). `SparseCoreKernel.preprocess`
always builds the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from tpurec.embedding import ops
from tpurec.embedding.cpu_path import grad_trigger, writes_final_layout
from tpurec.embedding.kjt_checks import check_kjt_shape
from tpurec.embedding.optimizers.base import DirectHead
from tpurec.runtime import device as _device
from tpurec.runtime import env_flags

# `kernel` arguments are SparseCoreKernels, typed Any: tpurec.embedding.kernel imports this module.


def _available() -> bool:
    if env_flags.is_on("TPUREC_NO_DIRECT"):
        return False
    from tpurec.embedding import csr_build

    return csr_build.available()  # numba present and not switched off (TPUREC_NO_NUMBA)


def applies(kernel: Any) -> bool:
    """Whether `kernel`'s next step may take the direct path (see the module docstring).

    The verdict is kept per kernel with what it was drawn from: the optimizer spec, the table and
    state tensors (by identity), the settings, limits and switches (by value); it is drawn again only
    when one of them changed. At pooling 1 the checks cost as much as the step's arithmetic, and the
    cheap comparison here is what remains of them per batch."""
    values = (
        kernel.inputs.settings,
        kernel.max_ids_per_partition,
        kernel.max_unique_ids_per_partition,
        env_flags.get(_device.EMULATE_ENV),  # the emulated TPU rank's fixed limits (device.tpu_path)
        env_flags.get("TPUREC_NO_DIRECT"),
        env_flags.get("TPUREC_NO_NUMBA"),
        torch.compiler.is_compiling(),
        ops.reference_is_cpu_kernel(),  # the TorchTPU stand-in replaces the CPU kernels
    )
    objects = (kernel.optimizer, type(kernel.optimizer).direct_fields, *kernel._buffers.values())
    seen = kernel.__dict__.get("_direct_checked")
    if seen is not None and seen[0] == values and len(seen[1]) == len(objects):
        for a, b in zip(seen[1], objects):
            if a is not b:
                break
        else:
            return seen[2]
    verdict = _applies(kernel)
    kernel.__dict__["_direct_checked"] = (values, objects, verdict)
    return verdict


def _applies(kernel: Any) -> bool:
    if not kernel.stacks or kernel.fixed_limits:
        return False
    if kernel.max_ids_per_partition is not None or kernel.max_unique_ids_per_partition is not None:
        return False
    if not writes_final_layout(kernel.stack_weight(0)) or not _available():  # the stand-in, tracing, ...
        return False
    return _tables_and_spec_fit(kernel)


def _tables_and_spec_fit(kernel: Any) -> bool:
    spec = kernel.optimizer
    known = spec.direct_fields  # the fields its `direct_update` implements (optimizers/base.py)
    if known is None:
        return False
    for f in fields(spec):
        if f.name not in known and getattr(spec, f.name) not in (None, 0, 0.0, False):
            return False
    for i, plan in enumerate(kernel.stacks):
        lay, weight = plan.layout, kernel.stack_weight(i)
        if lay.dtype != torch.float32 or lay.storage_dim != lay.dim or not writes_final_layout(weight):
            return False
        if not weight.is_contiguous():
            return False
        for s in spec.state_names:
            st = kernel.stack_state(i, s)
            if st.dtype != torch.float32 or not st.is_contiguous() or type(st) is not torch.Tensor:
                return False
    return True


# One stack's slice of the batch as numpy: ids, lengths (slot-major), float32 weights or None, and
# the slots' value offsets within the slice [slots + 1].
HostPart = tuple[np.ndarray, np.ndarray, "np.ndarray | None", np.ndarray]


def host_parts(kernel: Any, features: Any, batch: int) -> list[HostPart]:
    """Per stack, its slice of the KJT (keys in the kernel's stacked order) as numpy views, checked as
    `kjt_checks.check_kjt` checks it. A KJT in stacked order takes one compiled pass over its lengths
    and no torch op: this runs every step, after kernels that evicted the caches, where each torch
    reduction costs ~10-25 us; any other KJT (or one failing a check, or a batch whose demand is
    being recorded) takes `KernelInput.stack_arrays`, which raises the checks' messages."""
    from tpurec.embedding import direct_kernels as dk

    inputs = kernel.inputs
    values, weights = features.values(), features.weights_or_none()
    if (
        inputs.table_demand is None
        and not inputs.positional
        and features.keys() == inputs.stacked_order
        and not (values.is_floating_point() or values.dtype == torch.bool)
        and (weights is not None or not inputs.is_weighted)
        and (weights is None or weights.numel() == values.numel())
    ):
        check_kjt_shape(features)
        lengths = features.lengths().numpy()
        ends = np.empty(len(inputs.stacked_order) + 1, np.int64)
        if dk.slot_ends(lengths, batch, ends) >= 0 and ends[-1] == values.numel():
            w = weights.detach().to(torch.float32).contiguous().numpy() if inputs.is_weighted else None
            return _cut(kernel, values.numpy(), lengths, w, ends, batch)
    _, _, parts = inputs.stack_arrays(features)
    out = []
    for plan, (v, lengths, weights) in zip(kernel.stacks, parts):
        ns = len(plan.features)
        ends = np.zeros(ns + 1, np.int64)
        if batch:
            np.cumsum(lengths.numpy().reshape(ns, batch).sum(1), out=ends[1:])
        w = weights.to(torch.float32).contiguous().numpy() if weights is not None else None
        out.append((v.numpy(), lengths.numpy(), w, ends))
    return out


def _cut(
    kernel: Any, values: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None, ends: np.ndarray, batch: int
) -> list[HostPart]:
    parts: list[HostPart] = []
    k0 = 0
    for plan in kernel.stacks:
        n = len(plan.features)
        lo, hi = ends[k0], ends[k0 + n]
        w = weights[lo:hi] if weights is not None else None
        parts.append((values[lo:hi], lengths[k0 * batch : (k0 + n) * batch], w, ends[k0 : k0 + n + 1] - lo))
        k0 += n
    return parts


def lookup(kernel: Any, parts: list[HostPart], batch: int) -> torch.Tensor | None:
    """Pooled [batch, sum of dims] in feature order with the fused update in backward, from
    `host_parts`' per-stack slices; None when an id is out of its table's range (the layout path then
    raises its message) or a sort key would not fit."""
    from tpurec.embedding import direct_kernels as dk

    grad = torch.is_grad_enabled()
    inputs = []
    for i, (values, lengths, weights, ends) in enumerate(parts):
        st = _stack(kernel, i)
        ns, n = st.slots, values.size
        want_gains = weights is not None or st.has_mean
        key_bits = max(int((n if want_gains else batch * ns) - 1).bit_length(), 1)
        if st.row_bits + key_bits > 63:
            return None
        # uint32 keys sort about twice as fast as int64 ones
        keys = np.empty(n if grad else 0, np.uint32 if st.row_bits + key_bits <= 32 else np.int64)
        # The forward's bags in the input's feature-major order when the ids outnumber an eighth of
        # the output's floats: embedding_bag then reads one table at a time (its rows stay in cache)
        # and the ids stay where they are, at the cost of one copy of the output into batch-major
        # [batch, slots * dim] (measured: pooling 20-100 ~10-25% faster; pooling 1 slower).
        batch_major = ns == 1 or 8 * n < batch * ns * st.dim
        ids, boff, fwd_w, scale, bag_of, gains, bad = dk.bags(
            values, lengths, _NO_WEIGHTS if weights is None else weights, weights is not None, st.mean, st.shared,
            st.offsets, st.rows, batch, want_gains, grad, key_bits, keys, batch_major,
        )  # fmt: skip
        if bad >= 0:
            return None
        segments = None
        if grad and st.first_row.size == 1:  # one table: all the keys
            segments = np.array([[0, n, st.first_row[0], ns > 1]], np.int64)
        elif grad:  # each table's keys: the ids of its feature slots, one run of the input
            segments = np.empty((st.first_row.size, 4), np.int64)
            segments[:, 0], segments[:, 1], segments[:, 2] = ends[st.first_slot], ends[st.end_slot], st.first_row
            segments[:, 3] = st.end_slot - st.first_slot > 1  # a table several feature slots share
        t_ids, t_boff, t_w, t_scale = (torch.from_numpy(x) for x in (ids, boff, fwd_w, scale))
        inputs.append(_Bags(t_ids, t_boff, t_w, t_scale, gains, keys, key_bits, segments, bag_of, ns, batch_major))
    trigger = grad_trigger() if grad else None
    outs = [_DirectLookup.apply(trigger, kernel, i, b, batch) for i, b in enumerate(inputs)]
    return kernel._feature_order_output(outs)


_NO_WEIGHTS = np.empty(1, np.float32)


@dataclass
class _Stack:
    """What the direct step reads of stack i, as numpy, made once per kernel (`_stack`)."""

    slots: int
    offsets: np.ndarray  # int64 first stack row of each feature slot's table
    rows: np.ndarray  # int64 rows of each slot's table (the id check)
    mean: np.ndarray  # bool per slot
    shared: np.ndarray  # bool per slot: its table is read by several slots
    has_mean: bool
    # the stack's tables: a table's features are consecutive slots (kernel order), its rows one run
    first_slot: np.ndarray
    end_slot: np.ndarray
    first_row: np.ndarray
    row_bits: int  # bits of the largest table's row numbers
    dim: int  # the stack's row width


def _stack(kernel: Any, i: int) -> _Stack:
    cache = kernel.__dict__.setdefault("_direct_stacks", {})
    if i not in cache:
        offsets, rows, mean = kernel.inputs.stack_tensors[i]
        plan = kernel.stacks[i]
        runs: list[list] = []  # [first slot, past the last, first stack row, table] per feature slot run
        for k, (_, name) in enumerate(plan.features):
            if runs and runs[-1][3] == name:
                runs[-1][1] = k + 1
            else:
                runs.append([k, k + 1, plan.layout.table(name).offset, name])
        first, end, base, names = (list(c) for c in zip(*runs))
        shared = np.zeros(len(plan.features), np.bool_)
        for a, b, _, _ in runs:
            shared[a:b] = b - a > 1
        cache[i] = _Stack(
            len(plan.features), offsets.numpy(), rows.numpy(),
            mean.numpy() if mean is not None else np.zeros(len(plan.features), np.bool_), shared, mean is not None,
            np.array(first), np.array(end), np.array(base, np.int64),
            max((kernel._table[t].num_embeddings - 1).bit_length() for t in names), plan.layout.dim,
        )  # fmt: skip
    return cache[i]


@dataclass
class _Bags:
    """One stack's batch in batch-major bags (direct_kernels.bags) and its backward's sort keys."""

    ids: torch.Tensor  # int64 stacked rows
    offsets: torch.Tensor  # int64 [bags + 1]
    weights: torch.Tensor  # float32 the ids' own weights, or empty (all 1)
    scale: torch.Tensor  # float32 per bag (1 / length where its slot mean-pools), or empty (no mean slot)
    gains: np.ndarray  # float32 per key's low part (entries with their own gains), else empty
    keys: np.ndarray  # uint32 or int64 per id in input order (empty without backward)
    key_bits: int
    segments: np.ndarray | None  # int64 [tables, 4]: first key, past the last, first stack row, shared
    bag_of: np.ndarray  # int32 batch-major bag per key's low part (empty without backward)
    slots: int
    batch_major: bool  # the forward's bags (ids, offsets, scale): batch-major, else feature-major


class _DirectLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor | None, kernel: Any, i: int, bags: _Bags, batch: int) -> torch.Tensor:
        ctx.kernel, ctx.i, ctx.bags = kernel, i, bags
        ctx.lr = kernel.forward_lr()  # the update's lr: fixed when the forward runs, as stock's
        weight = kernel.stack_weight(i)
        dim = weight.shape[1]
        if bags.ids.numel() == 0:  # no ids (batch 0 or all bags empty): embedding_bag wants some
            return torch.zeros(batch, bags.slots * dim)
        # torch.embedding_bag itself: F.embedding_bag's argument checks cost ~10 us a call (pooling 1)
        out = torch.embedding_bag(
            weight, bags.ids, bags.offsets, False, 0, False, bags.weights if bags.weights.numel() else None, True
        )[0]  # mode 0: sum (fma(w, row, sum) with weights, as FBGEMM's CPU forward); include_last_offset
        if bags.scale.numel():  # mean-pooled slots: the sum times 1 / length, FBGEMM's rounding
            out.mul_(bags.scale.unsqueeze(1))
        if not bags.batch_major:  # [slots, batch, dim] -> [batch, slots * dim]
            return out.view(bags.slots, batch, dim).transpose(0, 1).reshape(batch, bags.slots * dim)
        return out.view(batch, bags.slots * dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:  # numpy and numba only: no autograd
        from tpurec.embedding import key_sort

        kernel, i, bags, lr = ctx.kernel, ctx.i, ctx.bags, ctx.lr
        for hook in kernel.pre_update_hooks:
            hook()
        kernel._steps[i] += 1
        spec, weight = kernel.optimizer, kernel.stack_weight(i)
        if grad.dtype != torch.float32 or not grad.is_contiguous() or grad.requires_grad:  # (create_graph)
            grad = grad.detach().to(torch.float32).contiguous()
        g = grad.numpy().reshape(-1, weight.shape[1])  # numpy's reshape: a torch view costs a dispatch
        states = [kernel.stack_state(i, s).numpy() for s in spec.state_names]
        # a row's entries adjacent, rows increasing (numpy's sort or a radix sort: key_sort.py)
        key_sort.sort_keys(bags.keys, bags.segments, bags.key_bits, _stack(kernel, i).row_bits)
        head: DirectHead = (bags.keys, bags.key_bits, bags.segments, bags.gains, bags.bag_of, g, weight.numpy())
        # the optimizer's own loop (its spec's `direct_update`: applies() admits only specs that have one),
        # weight decay of the touched rows fused into it (`OptimizerSpec.direct_decay`)
        spec.direct_update(head, states, lr, kernel._steps[i])
        return None, None, None, None, None
