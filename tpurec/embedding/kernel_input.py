"""KernelInput: a SparseCoreKernel's host half, from a KeyedJaggedTensor to one SparseCore input per stack.

The kernel (kernel.py) keeps the tables' storage, the lookup and the fused update; this class builds
what the lookup consumes, on the host (data-dependent shapes): the tables' stacks and their features
in stacked order, the id limits per stack (given, measured per table, or fixed by the first batch),
the CSR/COO build of each stack (the compiled build when it applies, else torch + numpy and
`preprocess`), a batch over its limits split into passes (multipass.py) or several batches stacked
into blocks, and the figures a run reports (stats per stack, dropped ids, multipass batches, each
table's demand).

Per stack, the stacked batch is interleaved per SparseCore as TorchTPU's preprocessing lays it out
(see kernel.py's docstring): SparseCore c's slice holds samples c*B'/S..(c+1)*B'/S-1 of every
feature (`stacked_samples`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

import torch
from torchrec.modules.embedding_configs import PoolingType

from tpurec.embedding import csr_build, host_threads, input_copy
from tpurec.embedding.constraints import DIM_ALIGN, SEGMENT_ALIGN, round_up
from tpurec.embedding.cpu_path import writes_final_layout
from tpurec.embedding.demand import ShardsDemand, TableShards
from tpurec.embedding.kernel_table import KernelTable, out_of_range
from tpurec.embedding.kjt_checks import check_kjt
from tpurec.embedding.layout import StackLayout, build_stacks
from tpurec.embedding.multipass import MultiPassInput, split_into_passes, stacked_blocks
from tpurec.embedding.optimizers.base import OptimizerSpec
from tpurec.embedding.optimizers.weight_decay import DecayInput, decay_input
from tpurec.embedding.preprocess import IdLimitExceededError, PreprocessStats, SparseCoreInput, preprocess
from tpurec.embedding.settings import FIRST_BATCH_HEADROOM, UNIQUE_SIGMAS, KernelSettings
from tpurec.embedding.stack_limits import initial_limits
from tpurec.errors import UserError
from tpurec.runtime import device as _device
from tpurec.runtime import host_copies
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# One stack's slice of a batch: (values, lengths, weights or None), in stacked feature order.
StackArrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# One stack's batch as SparseCore entries: (SparseCore ids, device samples, gains).
StackEntries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# What one stack's lookup consumes: within its limits, over them (passes), or with weight decay on the
# TPU path (a DecayInput, or a MultiPassInput carrying its decays).
StackInput = SparseCoreInput | MultiPassInput | DecayInput


@dataclass
class StackPlan:
    layout: StackLayout
    features: list[tuple[str, str]] = field(default_factory=list)  # (feature, table) in stacked order


class KernelInput:
    """The host half of one SparseCoreKernel (see the module docstring); the kernel reads its figures
    (`last_stats`, `dropped_id_count`, `multipass_batches`, `table_demand`, ...) through properties."""

    def __init__(
        self,
        tables: list[KernelTable],
        stored: Mapping[str, torch.dtype],
        *,
        num_sc: int,
        settings: KernelSettings,
        optimizer: OptimizerSpec,
        is_weighted: bool,
        positional: bool,
        storage: Callable[[int], torch.Tensor],
    ) -> None:
        """tables: validated (kernel_table.index_tables); stored: each table's storage dtype;
        storage: stack i's stored table (its device and kind decide the fixed limits' default, the
        weight decay's layout and where the inputs go)."""
        self.tables = tables
        self.table, self.feature_table = {t.name: t for t in tables}, {f: t for t in tables for f in t.feature_names}
        self.num_sc = num_sc
        self.settings = settings
        self.optimizer = optimizer
        self.is_weighted = is_weighted
        self.positional = positional
        self._storage = storage
        # Output order = EBC's: tables in order, each table's features in order.
        self.feature_order = [f for t in tables for f in t.feature_names]
        self.stacks = self._plan_stacks(stored)
        # Per stack, per feature slot: its table's offset in the stack, its row count (for the id
        # check) and whether it mean-pools; and where each stacked slot sits in feature_order.
        self.stacked_order = [f for plan in self.stacks for f, _ in plan.features]
        self.stacked_positions = [self.feature_order.index(f) for f in self.stacked_order]
        self.stack_tensors = [self._slot_tensors(plan) for plan in self.stacks]
        # Per stack: (max ids, max unique ids) once fixed; None until the first batch sets them.
        self._stack_limits = self._initial_limits()
        self._init_counters()
        self.wire_forms = input_copy.WireForms()  # the inputs' forms on their way to the device, kept

    def _plan_stacks(self, stored: Mapping[str, torch.dtype]) -> list[StackPlan]:
        layouts = build_stacks(
            [(t.name, t.num_embeddings, t.embedding_dim, stored[t.name]) for t in self.tables],
            self.num_sc,
            stack=bool(self.settings.stack_tables),
            pad_to=DIM_ALIGN if self.settings.pad_dims else 1,
            expected_ids={t.name: t.expected_ids for t in self.tables if t.expected_ids is not None},
            max_bytes=self.settings.max_stack_bytes,
        )
        stacks = []
        for lay in layouts:
            plan = StackPlan(lay)
            # Features in the kernel's table order, whatever the tables' placement in the stack: the
            # KJT then needs no permuting per batch.
            members = {ts.name for ts in lay.tables}
            for t in self.tables:
                if t.name in members:
                    plan.features.extend((f, t.name) for f in t.feature_names)
            stacks.append(plan)
        return stacks

    def _slot_tensors(self, plan: StackPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        tabs = [self.table[t] for _, t in plan.features]
        offsets = torch.tensor([plan.layout.table(t.name).offset for t in tabs], dtype=torch.int64)
        rows = torch.tensor([t.num_embeddings for t in tabs], dtype=torch.int64)
        mean = torch.tensor([t.pooling is PoolingType.MEAN for t in tabs])
        return offsets, rows, mean if bool(mean.any()) else None

    def _initial_limits(self) -> list[tuple[int, int] | None]:
        return initial_limits([plan.layout for plan in self.stacks], self.table, self.settings, self.num_sc)

    def _init_counters(self) -> None:
        self.last_stats: dict[str, PreprocessStats] = {}
        # The last batch when it took the direct path (direct.py), which builds no layout: its stats
        # are built from it when asked for (`stats`).
        self.stats_pending: KeyedJaggedTensor | None = None
        self.dropped_id_count = 0
        self.multipass_batches = 0  # stack inputs run as several passes (over their limits)
        # {} to record every table's demand per batch (tpurec.embedding.demand): by the table's source
        # name, [max ids, max unique ids per partition, the same per slice, most ids of one sample,
        # batches, most ids of one feature] over the batches seen.
        self.table_demand: dict[str, list[int]] | None = None
        self.table_passes: dict[str, list[int]] = {}  # with table_demand: [multipass batches, dropped ids]
        # The kernel counts the demand itself (`record_demand`), on the batch as it came, not on the
        # inputs it makes of it (a sequence kernel's one-id bags: SparseCoreSequenceKernel).
        self.demand_counted_by_kernel = False
        self._demand_counters: dict[tuple[int, int], ShardsDemand] = {}
        self._no_mean: dict[int, torch.Tensor] = {}  # all-False mean flags per slot count (compiled build)

    # -- limits --------------------------------------------------------------------------------
    @property
    def fixed_limits(self) -> bool:
        if self.settings.fixed_limits is not None:
            return self.settings.fixed_limits
        return bool(self.stacks) and _device.tpu_path(self._storage(0).device.type)

    def stack_limits(self, i: int) -> tuple[int, int] | None:
        """Stack i's fixed (max ids, max unique ids) per partition; None until set (or when not fixed)."""
        return self._stack_limits[i] if self.fixed_limits else None

    def set_stack_limits(self, i: int, limits: tuple[int, int]) -> None:
        """Fix stack i's limits to `limits` (the sharded modules raise them to every rank's largest:
        tpurec/sharding/rank_limits.py)."""
        self._stack_limits[i] = limits

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, PreprocessStats]:
        """PreprocessStats of the last batch per stack (built on demand after a direct step)."""
        pending, self.stats_pending = self.stats_pending, None
        if pending is not None:
            demand, self.table_demand = self.table_demand, None  # the batch was counted when it ran
            try:
                self.preprocess(pending)
            finally:
                self.table_demand = demand
        return self.last_stats

    # -- batches -----------------------------------------------------------------------------------
    def preprocess(self, features: KeyedJaggedTensor) -> list[StackInput]:
        """Host side: one SparseCore input per stack (data-dependent; runs on the CPU).

        Vectorised over features: the KJT is put in stacked order once (a no-op when it already is),
        then each stack's features are one contiguous slice of values and lengths. The stacks'
        compiled builds run side by side on threads (host_threads.py); everything that records (stats,
        counters, limits) runs after, in this thread, in stack order, as one stack after another would.
        """
        return self.to_device(self.preprocess_on_host(features))

    def preprocess_on_host(self, features: KeyedJaggedTensor) -> list[StackInput]:
        """`preprocess` but its last move: the inputs on the host (`to_device` moves them; the
        benchmarks time the two apart)."""
        # Preprocessing is host work (data-dependent shapes). Under DMP the ids arrive on the host
        # (tpurec.sharding.host_input_dist); a KJT a caller put on the device is copied back, counted.
        self.stats_pending = None  # this batch's stats replace a direct step's
        features = host_copies.to_host(features, "ids")
        batch, padded, parts = self.stack_arrays(features)
        built = self._compiled_stacks(parts, batch, padded)
        return [self._finish_stack(i, built[i], *part, batch, padded) for i, part in enumerate(parts)]

    def _compiled_stacks(
        self, parts: list[StackArrays], batch: int, padded: int
    ) -> list[tuple[SparseCoreInput, PreprocessStats] | None]:
        """Each stack's compiled build (`_compiled_csr`), on threads when there are several: the builds
        read shared state only and release the GIL (numba, numpy's sort). The torch + numpy route of a
        stack the build leaves (None) runs later in the calling thread: its torch ops use torch's own
        threads, and on several pool threads at once they would take a core count each."""
        if len(parts) < 2 or not csr_build.available():
            return [self._compiled_csr(i, *part, batch, padded) for i, part in enumerate(parts)]
        csr_build.prepare()  # the one-time sort choice, timed here and not amid the builds
        sizes = [int(values.numel()) for values, _, _ in parts]
        return host_threads.map_tasks(lambda i: self._compiled_csr(i, *parts[i], batch, padded), len(parts), sizes)

    def preprocess_blocks(self, blocks: list[KeyedJaggedTensor]) -> list[StackInput]:
        """Several batches of one stride as one step: their lookups stacked along the output's rows
        (block j's rows j x batch ..), one fused update in which every row the blocks touch takes
        its whole gradient once (multipass.stacked_blocks). What a sequence batch over its fixed
        capacity runs as: each block has the fixed shapes, so a TPU reuses the step's programs."""
        inputs: list[list[Any]] = []  # per block, its stacks' inputs, as stacked_blocks takes them
        entries: list[list[StackEntries]] = []
        for kjt in blocks:
            batch, padded, parts = self.stack_arrays(host_copies.to_host(kjt, "ids"))
            inputs.append([self.stack_input(i, *part, batch, padded) for i, part in enumerate(parts)])
            entries.append([self._stack_entries(i, *part, batch, padded) for i, part in enumerate(parts)])
        out: list[StackInput] = []
        for i, plan in enumerate(self.stacks):
            d = len(plan.features) * padded
            max_ids, max_uniq = self.stack_limits(i) or (
                self.settings.max_ids_per_partition or d,
                self.settings.max_unique_ids_per_partition or d,
            )
            blocked = stacked_blocks(
                [b[i] for b in inputs],
                [e[i] for e in entries],
                device_batch_size=d,
                num_sc_per_device=self.num_sc,
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_uniq,
                table_name=plan.layout.name,
            )
            out.append(blocked)
            self.stats()[plan.layout.name].passes = blocked.passes
        self.multipass_batches += 1
        return self.to_device(out)

    def stack_arrays(self, features: KeyedJaggedTensor, demand: bool = True) -> tuple[int, int, list[StackArrays]]:
        """(batch, padded batch, per stack its (values, lengths, weights)): the KJT in stacked order,
        cut into one contiguous slice per stack; the batch's demand recorded when asked for (and
        `demand`: False for a second look at a batch already counted)."""
        values, lengths, weights = self.stacked_arrays(features)
        batch = features.stride()
        padded = round_up(max(batch, 1), self.num_sc)
        per_slot = lengths.view(-1, batch).sum(1) if batch else torch.zeros(len(self.stacked_order), dtype=torch.long)
        value_offsets = [0] + torch.cumsum(per_slot, 0).tolist()
        if demand and self.table_demand is not None and not self.demand_counted_by_kernel:
            self._record_demand(values, lengths, batch)
        parts: list[StackArrays] = []
        k0 = 0
        for plan in self.stacks:
            n = len(plan.features)
            lo, hi = value_offsets[k0], value_offsets[k0 + n]
            parts.append(
                (values[lo:hi], lengths[k0 * batch : (k0 + n) * batch], weights[lo:hi] if weights is not None else None)
            )
            k0 += n
        return batch, padded, parts

    def to_device(self, csrs: list[StackInput]) -> list[StackInput]:
        """Inputs made on the host, on the kernel's device (they stay on a CPU or "meta" kernel's host)."""
        device = self._storage(0).device if self.stacks else torch.device("cpu")
        # A kernel on "meta" holds no tables: a preprocessing-only kernel (benchmarks, pipelines
        # sizing buffers), whose inputs stay on the host.
        if device.type not in (DeviceKind.CPU, "meta"):
            if csrs and all(type(c) is SparseCoreInput for c in csrs) and input_copy.wanted():
                # one copy per dtype for every stack's tensors, not four a stack (input_copy.py)
                # in the forms this kernel's inputs crossed in before (input_copy.WireForms)
                inputs = cast("list[SparseCoreInput]", csrs)
                return list(input_copy.inputs_to_device(inputs, device, self.wire_forms))
            csrs = [c.to(device) for c in csrs]
        return csrs

    def stacked_arrays(self, features: KeyedJaggedTensor) -> StackArrays:
        """(values, lengths, weights) of the KJT with keys in stacked order, checked."""
        check_kjt(features)
        keys = features.keys()
        if self.positional:
            if len(keys) != len(self.feature_order):
                raise KeyError(f"expected {len(self.feature_order)} features in table order, got keys {keys}")
            perm = self.stacked_positions
        else:
            index = {k: j for j, k in enumerate(keys)}
            missing = [f for f in self.feature_order if f not in index]
            if missing:
                raise KeyError(f"KeyedJaggedTensor lacks features {missing}; it has {keys}")
            perm = [index[f] for f in self.stacked_order]
        if perm != list(range(len(keys))):
            features = features.permute(perm)
        values = features.values()
        if values.is_floating_point() or values.dtype == torch.bool:
            raise TypeError(f"embedding ids must be integers, got dtype {values.dtype}")
        weights = features.weights_or_none()
        if self.is_weighted and weights is None:
            raise UserError("this kernel is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
        # Gains are host data; a trainable weight's gradient comes from weight_grad.with_weight_grad.
        return values, features.lengths(), weights.detach() if self.is_weighted and weights is not None else None

    # -- demand --------------------------------------------------------------------------------
    def record_demand(self, features: KeyedJaggedTensor) -> None:
        """Count this batch's demand (when asked for: `table_demand`) as it is, in its own samples."""
        if self.table_demand is not None:
            values, lengths, _ = self.stacked_arrays(features)
            self._record_demand(values, lengths, features.stride())

    def _record_demand(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> None:
        """Each table's demand in this batch, counted as `tpurec data stats` counts it (the table
        alone, its shard's rows, this kernel's SparseCores): the feedback for the next run's limits.
        Per table (by its source name): the four partition / slice figures, the most ids of a
        sample, the batches counted, the most ids of one feature in a batch (a sequence table's
        capacity, `max_ids_per_feature`)."""
        # a counter per batch size and thread (pipeline workers preprocess side by side; its stamps are its own)
        key = (batch, threading.get_ident())
        counter = self._demand_counters.get(key)
        if counter is None:
            tables = [
                TableShards(
                    name,
                    tuple(f for f in self.stacked_order if self.feature_table[f].name == name),
                    self.table[name].num_embeddings,
                    ((0, self.table[name].num_embeddings),),
                )
                for name in dict.fromkeys(self.feature_table[f].name for f in self.stacked_order)
                # a row-wise shard of a table smaller than the devices holds no rows: no id lands here
                if self.table[name].num_embeddings > 0
            ]
            counter = self._demand_counters[key] = ShardsDemand(
                tables, list(self.stacked_order), num_partitions=self.num_sc, batch=batch
            )
        try:
            figures = counter.count(values.numpy(), lengths.numpy(), batch)
        except UserError:  # an id outside its table: the stack input refuses it, naming the feature
            return
        for t, d in zip(counter.tables, figures):
            k = self.table[t.name]
            seen = self.table_demand.setdefault(k.source or k.name, [0] * 7)  # type: ignore[union-attr]
            seen[:5] = [max(a, b) for a, b in zip(seen[:5], d[:5])]
            seen[5] += 1
            seen[6] = max(seen[6], d[5])

    def _record_passes(self, i: int, stats: PreprocessStats) -> None:
        """Per table of stack i (source name): batches its stack ran in several passes, ids its
        stack dropped (shared by the stack's tables)."""
        if self.table_demand is None:
            return
        for name in dict.fromkeys(t for _, t in self.stacks[i].features):
            k = self.table[name]
            seen = self.table_passes.setdefault(k.source or k.name, [0, 0])
            seen[0] += stats.passes > 1
            seen[1] += stats.dropped_id_count

    # -- one stack -------------------------------------------------------------------------------
    def _stack_entries(
        self, i: int, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, batch: int, padded: int
    ) -> StackEntries:
        """Stack i's batch as SparseCore entries: (SparseCore ids, device samples, gains), checked."""
        plan, lay = self.stacks[i], self.stacks[i].layout
        offsets, rows, mean = self.stack_tensors[i]
        n = len(plan.features)
        seg = torch.repeat_interleave(torch.arange(n * batch, device=values.device), lengths.long())
        slot = seg // batch if batch else seg
        ids = values.to(torch.int64)
        bad = (ids < 0) | (ids >= rows.index_select(0, slot))
        if ids.numel() and bool(bad.any()):
            self._raise_bad_ids(plan, ids, slot, bad)
        gains = weights.to(torch.float32) if weights is not None else torch.ones(ids.numel(), device=ids.device)
        if mean is not None:
            per_id_len = lengths.clamp(min=1).to(torch.float32).index_select(0, seg)
            gains = torch.where(mean.index_select(0, slot), gains / per_id_len, gains)
        samples = stacked_samples(slot, seg - slot * batch, n, padded, self.num_sc)
        # Natural stacked rows, renamed so that the SparseCore's MOD partitioning finds them in the
        # natural-order storage (layout.py).
        stacked_ids = lay.sparsecore_ids(ids + offsets.index_select(0, slot))
        return stacked_ids, samples, gains

    def _limits(self, i: int, entries: StackEntries, common: dict[str, Any]) -> tuple[int | None, int | None]:
        """Stack i's (max ids, max unique ids) for this batch: the given ones when limits follow the
        batch, else the fixed ones, set from this first batch if none (its fullest partition's ids
        times 1 + `first_batch_headroom`, KernelSettings; its distinct ids times 2, or under a smaller
        headroom `unique_factor`'s)."""
        if not self.fixed_limits:
            return self.settings.max_ids_per_partition, self.settings.max_unique_ids_per_partition
        limits = self._stack_limits[i]
        if limits is None:
            _, first = preprocess(*entries, **common)
            headroom = self.settings.first_batch_headroom
            headroom = FIRST_BATCH_HEADROOM if headroom is None else headroom

            def bound(n: int, factor: float) -> int:
                return round_up(max(SEGMENT_ALIGN, math.ceil(factor * n)), SEGMENT_ALIGN)

            max_ids = bound(first.max_ids_per_partition, 1.0 + headroom)
            # the TensorCore update's optimizer touches this many rows a partition
            # (update_jax.distinct_rows_bound), the lookup none; a batch over it runs in passes
            uniq = bound(
                first.max_unique_ids_per_partition, unique_factor(first.max_unique_ids_per_partition, headroom)
            )
            limits = self._stack_limits[i] = (max_ids, min(uniq, max_ids))
        return limits

    def stack_input(
        self, i: int, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, batch: int, padded: int
    ) -> StackInput:
        """Stack i's SparseCore input for its slice of the batch (`stack_arrays`): by the compiled
        build when it applies, else by `preprocess`; over the limits, in passes or dropped."""
        compiled = self._compiled_csr(i, values, lengths, weights, batch, padded)
        return self._finish_stack(i, compiled, values, lengths, weights, batch, padded)

    def _finish_stack(
        self,
        i: int,
        compiled: tuple[SparseCoreInput, PreprocessStats] | None,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        batch: int,
        padded: int,
    ) -> StackInput:
        """`stack_input` given stack i's compiled build (`_compiled_csr`, None where it did not
        apply): its stats recorded, or the torch + numpy route run."""
        if compiled is not None:
            self._keep_stats(i, compiled[1])
            return self._row_slots(i, compiled[0], values, lengths, weights, batch, padded)
        lay, n = self.stacks[i].layout, len(self.stacks[i].features)
        entries = self._stack_entries(i, values, lengths, weights, batch, padded)
        common: dict[str, Any] = dict(device_batch_size=n * padded, num_sc_per_device=self.num_sc, table_name=lay.name)
        max_ids, max_uniq = self._limits(i, entries, common)
        csr: SparseCoreInput | MultiPassInput
        try:
            csr, stats = preprocess(
                *entries,
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_uniq,
                allow_id_dropping=self.settings.allow_id_dropping,
                **common,
            )
        except IdLimitExceededError:
            # Over the limits and no dropping asked for: several passes that each fit, equal to the
            # unsplit step (multipass.py); the buffers keep the limits' shapes.
            assert max_ids is not None  # without limits nothing is over them
            _, stats = preprocess(*entries, **common)  # the batch's own demand
            csr = split_into_passes(
                *entries,
                device_batch_size=n * padded,
                num_sc_per_device=self.num_sc,
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_uniq or max_ids,
                table_name=lay.name,
            )
            stats.passes = csr.passes
            self.multipass_batches += 1
        self._keep_stats(i, stats)
        return self._row_slots(i, csr, values, lengths, weights, batch, padded)

    def _keep_stats(self, i: int, stats: PreprocessStats) -> None:
        """Stack i's stats of this batch: the last ones, the dropped ids, the tables' passes."""
        self.stats()[self.stacks[i].layout.name] = stats
        self.dropped_id_count += stats.dropped_id_count
        self._record_passes(i, stats)

    def _row_slots(
        self,
        i: int,
        csr: SparseCoreInput | MultiPassInput,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        batch: int,
        padded: int,
    ) -> StackInput:
        """With weight decay, the TPU path takes the decay on the device in the shapes of a batch within
        its limits (optimizers/weight_decay.py, `DecayInput`: decoupled, a row scale before the
        ordinary update; L2, one more update entry per row), whether the batch is within its limits
        (the lookup stays `csr`) or over them (its update passes, `MultiPassInput.decays`). Without
        decay, or where the CPU reference has the rows at hand, `csr` as it is."""
        spec = self.optimizer
        if spec.weight_decay_mode is None or writes_final_layout(self._storage(i)):
            return csr
        lay = self.stacks[i].layout
        where: dict[str, Any] = dict(
            num_partitions=lay.num_partitions, rows_per_partition=lay.rows_per_partition, table_name=lay.name
        )
        if isinstance(csr, MultiPassInput) and spec.weight_decay_mode == "L2":  # each pass's rows, one entry each
            decays = [
                decay_input(spec, part, ids, slots, torch.ones(len(ids)), **where)
                for part, (ids, slots) in zip(csr.updates, csr.update_rows)
            ]
            return replace(csr, decays=decays)
        stacked_ids, samples, gains = self._stack_entries(i, values, lengths, weights, batch, padded)
        if isinstance(csr, MultiPassInput):  # decoupled: the batch's rows, at the limits' shapes
            return replace(csr, decays=[decay_input(spec, csr.updates[0], stacked_ids, samples, gains, **where)])
        return decay_input(spec, csr, stacked_ids, samples, gains, **where)

    def _compiled_csr(
        self, i: int, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, batch: int, padded: int
    ) -> tuple[SparseCoreInput, PreprocessStats] | None:
        """The same SparseCore input from the compiled build (`csr_build`) and its stats, or None: then
        the torch + numpy route of `stack_input` runs, which also owns every error message and the
        dropping. Records nothing (`_finish_stack` does): it runs on the pool's threads."""
        if values.device.type != DeviceKind.CPU or not csr_build.available():
            return None
        lay = self.stacks[i].layout
        offsets, rows, mean = self.stack_tensors[i]
        limits = self._stack_limits[i] if self.fixed_limits else None
        if self.fixed_limits and limits is None:
            return None  # the first batch sets fixed limits through the numpy route
        mi, mu = (
            limits
            if limits is not None
            else (
                self.settings.max_ids_per_partition,
                self.settings.max_unique_ids_per_partition,
            )
        )
        no_mean = self._no_mean.setdefault(len(offsets), torch.zeros(len(offsets), dtype=torch.bool))
        out = csr_build.stack_csr(
            values.numpy(),
            lengths.numpy(),
            weights.to(torch.float32).numpy() if weights is not None else None,
            batch=batch,
            padded=padded,
            offsets=offsets.numpy(),
            rows=rows.numpy(),
            mean=(mean if mean is not None else no_mean).numpy(),
            rows_per_partition=lay.rows_per_partition,
            num_sc=self.num_sc,
            num_partitions=lay.num_partitions,
            max_ids=mi,
            max_uniq=mu,
        )
        if out is None:
            return None
        rp, emb, smp, gns, mi, mu, (ids_pp, uniq_pp, need) = out
        t_rp, t_emb, t_smp, t_gns = (torch.from_numpy(x) for x in (rp, emb, smp, gns))
        csr = SparseCoreInput(t_rp, t_emb, t_smp, t_gns, len(offsets) * padded, self.num_sc, lay.num_partitions, mi, mu)
        return csr, PreprocessStats(torch.from_numpy(ids_pp), torch.from_numpy(uniq_pp), need, 0)

    def _raise_bad_ids(self, plan: StackPlan, ids: torch.Tensor, slot: torch.Tensor, bad: torch.Tensor) -> None:
        first = int(bad.nonzero()[0])
        f, tname = plan.features[int(slot[first])]
        raise out_of_range(self.table[tname], f, ids[slot == slot[first]])


def stacked_samples(slot: torch.Tensor, b: torch.Tensor, n: int, padded: int, num_sc: int) -> torch.Tensor:
    """Device sample of feature slot k's sample b in a stack of n features: SparseCore c = b div
    (padded / S) holds rows c*n*per .. (c+1)*n*per - 1 (per = padded / S), feature k's at k*per within."""
    per = padded // num_sc
    sc = b // per
    return sc * (n * per) + slot * per + (b - sc * per)


def unique_factor(first_unique: int, headroom: float) -> float:
    """The first batch's distinct ids times this make the fixed unique-id limit: 2 under the SparseCore
    default headroom (distinct ids vary more between batches than ids do); under a smaller one (the
    TensorCore kernel) 1 + the headroom, or + UNIQUE_SIGMAS / sqrt(count) where that is more (a
    Poisson count's spread: 100 distinct ids vary by about 10), at most 2."""
    if headroom >= FIRST_BATCH_HEADROOM:
        return 2.0
    return min(2.0, 1.0 + max(headroom, UNIQUE_SIGMAS / math.sqrt(max(first_unique, 1))))
