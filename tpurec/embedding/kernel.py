"""SparseCoreKernel: the embedding bags of one device, in the SparseCore layout, with the fused update.

The building block shared by the standalone `SparseCoreEmbeddingBagCollection` and by the sharded
lookups under `DistributedModelParallel`. It takes a KeyedJaggedTensor and returns the pooled
embeddings [batch, sum of dims] in feature order; backward through that output runs the fused
optimizer update op of every stack, in place, without materialising a dense table gradient.

Per stack (tables of one dim stored together), one forward builds one SparseCore input. The
stacked batch is interleaved per SparseCore, as TorchTPU's preprocessing lays it out (torchrec
`experimental/torch_tpu/modules/fused_embedding_modules.py`, `_unstack_activation`: the op's rows are
[SparseCores, features, B'/S, dim]): SparseCore c's slice holds samples c*B'/S..(c+1)*B'/S-1 of every
feature (B' = batch padded to a multiple of the SparseCore count S), so each SparseCore gets 1/S of
every feature's ids. (Feature-major slices gave one SparseCore whole features: on the MLPerf stack
56% of the ids and 4x the CSR buffers.) Ids are shifted by their table's offset in the stack, and
gains carry per-id weights and the 1/bag-length of mean pooling.
"""

from __future__ import annotations

import itertools
import re
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from tpurec.embedding import csr_build, direct, dtypes, ops, reference  # noqa: F401  (ops registers torch.ops.tpurec.*)
from tpurec.embedding.constraints import DIM_ALIGN, SEGMENT_ALIGN, round_up
from tpurec.embedding.cpu_path import grad_trigger as _trigger
from tpurec.embedding.cpu_path import writes_final_layout as _writes_final_layout
from tpurec.embedding.demand import ShardsDemand, TableShards
from tpurec.embedding.kjt_checks import check_kjt
from tpurec.embedding.layout import StackLayout, build_stacks
from tpurec.embedding.multipass import MultiPassInput, split_into_passes, stacked_blocks
from tpurec.embedding.optimizers.base import OptimizerSpec, check_hyperparameter, op_head, op_tail
from tpurec.embedding.optimizers.weight_decay import DecayInput, apply_decay, decay_input, decay_rows, decay_slots
from tpurec.embedding.preprocess import IdLimitExceededError, PreprocessStats, SparseCoreInput, preprocess
from tpurec.embedding.settings import KernelSettings
from tpurec.embedding.weight_grad import with_weight_grad
from tpurec.errors import UserError
from tpurec.runtime import device as _device
from tpurec.runtime import host_copies

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# Kernel numbers for computation names: unique within the process, fixed for a kernel's lifetime.
_KERNEL_NUMBERS = itertools.count()


@dataclass(frozen=True)
class KernelTable:
    """A table as this device sees it (under sharding: the local shard's rows and columns)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"  # "sum" | "mean"
    init_rows: int | None = None  # rows of the whole (unsharded) table, for EBC's init bound
    # The config's weight_init_min/max (TorchRec's get_weight_init_min/max); None: +-sqrt(1/rows).
    init_min: float | None = None
    init_max: float | None = None
    dtype: torch.dtype = torch.float32  # the config's dtype (stored as such unless widened)
    source: str | None = None  # the whole table's name when this is a shard (for messages)
    # Ids per sample this table expects over its features (pooling factors): when every table of a
    # stack has one, the stack places its tables so the SparseCore partitions share them (stack_order).
    expected_ids: float | None = None


@dataclass
class _StackPlan:
    layout: StackLayout
    features: list[tuple[str, str]] = field(default_factory=list)  # (feature, table) in stacked order


class SparseCoreKernel(nn.Module):
    def __init__(
        self,
        tables: Sequence[KernelTable],
        optimizer: OptimizerSpec,
        num_sc_per_device: int,
        *,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        positional: bool = False,
        settings: KernelSettings | None = None,
        **keywords: Any,
    ) -> None:
        """settings: the buffer and layout settings (KernelSettings, tpurec/embedding/settings.py,
        which says what each does); its fields may instead be passed as keywords.

        A stack whose tables all have table_limits gets fixed limits that bound every segment
        (`_stack_bound`). With fixed limits, limits come from max_ids_per_partition /
        max_unique_ids_per_partition when given, else from the first batch (twice its fullest
        partition, 8-aligned). A batch over the limits (fixed or given) runs in several passes that
        fit (multipass.py), or is dropped down to them when allow_id_dropping asks for it (counted in
        dropped_id_count)."""
        super().__init__()
        # positional: the KJT's k-th key feeds the k-th feature of feature_order (TorchRec's sharded
        # lookups pass keys in table order and may repeat a feature for column shards).
        self.positional = positional
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.settings = KernelSettings.of(settings, **keywords).resolved_for(device.type)
        max_ids_per_partition = self.settings.max_ids_per_partition
        max_unique_ids_per_partition = self.settings.max_unique_ids_per_partition
        allow_id_dropping = self.settings.allow_id_dropping
        table_limits = self.settings.table_limits
        if num_sc_per_device < 1:
            raise UserError(f"num_sc_per_device must be >= 1, got {num_sc_per_device}")
        self.tables = list(tables)
        self.optimizer = optimizer
        self.num_sc = num_sc_per_device
        self.is_weighted = is_weighted
        self.max_ids_per_partition = max_ids_per_partition
        self.max_unique_ids_per_partition = max_unique_ids_per_partition
        self.allow_id_dropping = allow_id_dropping
        if allow_id_dropping and optimizer.weight_decay_mode is not None:
            # The decay's update layout takes every id of the batch; a lookup that dropped some would
            # update rows it never read. Over its limits such a batch runs in passes instead.
            raise UserError(
                f"allow_id_dropping=True with weight decay ({optimizer.weight_decay_mode}) is not supported: "
                "leave allow_id_dropping off (a batch over its id limits then runs in several passes)"
            )
        self._fixed_limits = self.settings.fixed_limits
        # Optimizer steps taken per stack (Adam's bias correction); stacks update independently
        # because autograd may run their backward in any order. Public per table: step_count().
        self._steps: list[int] = []
        # Called before every fused update: fused optimizers pass on step counts written into their
        # checkpointed scalars in place (DCP's load), which no load_state_dict call announces.
        self.pre_update_hooks: list = []
        # The param group whose "lr" every update reads (see current_lr); None: the spec's lr.
        self.lr_source: dict | None = None
        self._last_stats: dict[str, PreprocessStats] = {}
        # The last batch when it took the direct path (direct.py), which builds no layout: its stats
        # are built from it when asked for (`last_stats`).
        self._stats_pending: KeyedJaggedTensor | None = None
        self.dropped_id_count = 0
        self.multipass_batches = 0  # stack inputs run as several passes (over their limits)
        # {} to record every table's demand per batch (tpurec.embedding.demand): by the table's source
        # name, [max ids, max unique ids per partition, the same per slice, most ids of one sample,
        # batches] over the batches seen.
        self.table_demand: dict[str, list[int]] | None = None
        self.table_passes: dict[str, list[int]] = {}  # with table_demand: [multipass batches, dropped ids]
        self._demand_counters: dict[tuple[int, int], ShardsDemand] = {}
        self._no_mean: dict[int, torch.Tensor] = {}  # all-False mean flags per slot count (compiled build)

        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise UserError(f"duplicate table names: {names}")
        self._table = {t.name: t for t in self.tables}
        self._feature_table: dict[str, KernelTable] = {}
        for t in self.tables:
            if t.pooling not in ("sum", "mean"):
                raise UserError(f"table {t.name!r}: pooling {t.pooling!r} is not supported (sum or mean)")
            for f in t.feature_names:
                if f in self._feature_table:
                    raise UserError(f"feature {f!r} is used by tables {self._feature_table[f].name!r} and {t.name!r}")
                self._feature_table[f] = t
        # Output order = EBC's: tables in order, each table's features in order.
        self.feature_order = [f for t in self.tables for f in t.feature_names]
        self.feature_dims = [self._feature_table[f].embedding_dim for f in self.feature_order]

        for t in self.tables:
            dtypes.table_dtype(t.dtype, t.name)  # refuses quantized dtypes
        stored = {t.name: dtypes.stored_dtype(t.dtype, device.type, self.settings.widen_tables) for t in self.tables}
        dtypes.warn_widened({t.source or t.name: t.dtype for t in self.tables if stored[t.name] != t.dtype})
        layouts = build_stacks(
            [(t.name, t.num_embeddings, t.embedding_dim, stored[t.name]) for t in self.tables],
            num_sc_per_device,
            stack=self.settings.stack_tables,
            pad_to=DIM_ALIGN if self.settings.pad_dims else 1,
            expected_ids={t.name: t.expected_ids for t in self.tables if t.expected_ids is not None},
        )
        self.stacks: list[_StackPlan] = []
        for lay in layouts:
            plan = _StackPlan(lay)
            # Features in the kernel's table order, whatever the tables' placement in the stack: the
            # KJT then needs no permuting per batch.
            members = {ts.name for ts in lay.tables}
            for t in self.tables:
                if t.name in members:
                    plan.features.extend((f, t.name) for f in t.feature_names)
            self.stacks.append(plan)
            self._steps.append(0)
        self._stack_of = {ts.name: i for i, plan in enumerate(self.stacks) for ts in plan.layout.tables}
        # Per stack: (max ids, max unique ids) once fixed; None until the first batch sets them.
        given = None
        if max_ids_per_partition is not None:
            given = (
                round_up(max_ids_per_partition, SEGMENT_ALIGN),
                round_up(max_unique_ids_per_partition or max_ids_per_partition, SEGMENT_ALIGN),
            )
        self._stack_limits: list[tuple[int, int] | None] = [given] * len(self.stacks)
        if table_limits:
            for i, plan in enumerate(self.stacks):
                bound = _stack_bound(plan.layout, self._table, table_limits, num_sc_per_device)
                if bound is not None:
                    self._stack_limits[i] = bound
        # One name per stack for TorchTPU's update ops, unique in the process and the same every step:
        # TorchTPU reuses a function by name inside one program, so stacks must not share one, and a
        # name that changed per step would compile a new program each time.
        number = next(_KERNEL_NUMBERS)
        self.computation_names = [
            f"tpurec_k{number}_{re.sub(r'[^0-9A-Za-z_]', '_', plan.layout.name)}_{optimizer.name}"
            for plan in self.stacks
        ]
        # Per stack, per feature slot: its table's offset in the stack, its row count (for the id
        # check) and whether it mean-pools; and where each stacked slot sits in feature_order.
        self._stacked_order = [f for plan in self.stacks for f, _ in plan.features]
        self._stacked_positions = [self.feature_order.index(f) for f in self._stacked_order]
        self._stack_tensors = []
        for plan in self.stacks:
            tabs = [self._table[t] for _, t in plan.features]
            offsets = torch.tensor([plan.layout.table(t.name).offset for t in tabs], dtype=torch.int64)
            rows = torch.tensor([t.num_embeddings for t in tabs], dtype=torch.int64)
            mean = torch.tensor([t.pooling == "mean" for t in tabs])
            self._stack_tensors.append((offsets, rows, mean if bool(mean.any()) else None))

        # Physical storage: one partition-major table per stack plus its optimizer state. Buffers
        # (not parameters): a dense optimizer must never touch them; state_dict hooks of the owning
        # module expose them per table in natural row order.
        device = torch.device(device) if device is not None else torch.device("cpu")
        for i, plan in enumerate(self.stacks):
            lay = plan.layout
            self.register_buffer(
                f"weight_{i}",
                torch.zeros(lay.total_rows, lay.storage_dim, dtype=lay.dtype, device=device),
                persistent=False,
            )
            for s in optimizer.state_names:  # float32 whatever the table's dtype, as FBGEMM keeps it
                shape = optimizer.state_shape(s, lay.total_rows, lay.storage_dim)
                init = optimizer.initial_value(s)
                self.register_buffer(f"{s}_{i}", torch.full(shape, init, device=device), persistent=False)
        self.reset_parameters()

    @property
    def last_stats(self) -> dict[str, PreprocessStats]:
        """PreprocessStats of the last batch per stack (built on demand after a direct step)."""
        pending, self._stats_pending = self._stats_pending, None
        if pending is not None:
            demand, self.table_demand = self.table_demand, None  # the batch was counted when it ran
            try:
                self.preprocess(pending)
            finally:
                self.table_demand = demand
        return self._last_stats

    @property
    def fixed_limits(self) -> bool:
        if self._fixed_limits is not None:
            return self._fixed_limits
        return bool(self.stacks) and _device.tpu_path(self.stack_weight(0).device.type)

    def stack_limits(self, i: int) -> tuple[int, int] | None:
        """Stack i's fixed (max ids, max unique ids) per partition; None until set (or when not fixed)."""
        return self._stack_limits[i] if self.fixed_limits else None

    # -- storage access ------------------------------------------------------------------------
    def stack_weight(self, i: int) -> torch.Tensor:
        return getattr(self, f"weight_{i}")

    def stack_state(self, i: int, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_{i}")

    def _locate(self, table: str) -> tuple[int, StackLayout]:
        i = self._stack_of.get(table)
        if i is None:
            raise KeyError(f"unknown table {table!r}; tables: {[t.name for t in self.tables]}")
        return i, self.stacks[i].layout

    @property
    def table_names(self) -> list[str]:
        """This kernel's tables in construction order (under sharding: shard names "table/k")."""
        return [t.name for t in self.tables]

    def step_count(self, table: str) -> int:
        """Fused updates applied to `table` so far (its stack's count: a stack updates as one)."""
        return self._steps[self._locate(table)[0]]

    def set_step_count(self, table: str, n: int) -> None:
        """Restore the step count (e.g. from a checkpoint); sets it for the whole stack of `table`."""
        self._steps[self._locate(table)[0]] = int(n)

    def read_weight(self, table: str) -> torch.Tensor:
        """[num_embeddings, dim] in natural row order: a view of the live storage (writes land in it)."""
        i, lay = self._locate(table)
        return lay.read_table(self.stack_weight(i), table)

    def write_weight(self, table: str, value: torch.Tensor) -> None:
        i, lay = self._locate(table)
        lay.write_table(self.stack_weight(i), table, value.to(self.stack_weight(i).device))

    def read_state(self, table: str, name: str) -> torch.Tensor:
        i, lay = self._locate(table)
        return lay.read_table(self.stack_state(i, name), table)

    def write_state(self, table: str, name: str, value: torch.Tensor) -> None:
        i, lay = self._locate(table)
        lay.write_table(self.stack_state(i, name), table, value.to(self.stack_state(i, name).device))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """TorchRec's init: uniform(weight_init_min, weight_init_max) per table, by default
        uniform(-sqrt(1/rows), sqrt(1/rows)); padding rows 0."""
        for t in self.tables:
            i, _ = self._locate(t.name)
            if self.stack_weight(i).is_meta:
                continue
            bound = (1.0 / max(t.init_rows or t.num_embeddings, 1)) ** 0.5
            lo = -bound if t.init_min is None else t.init_min
            hi = bound if t.init_max is None else t.init_max
            view = self.read_weight(t.name)
            if view.device.type == "cpu":  # in place: no second copy of a large table, same draws
                view.uniform_(lo, hi)
            else:  # drawn on the host so that a TPU run starts from the CPU run's tables
                view.copy_(torch.empty(t.num_embeddings, t.embedding_dim).uniform_(lo, hi))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """features: KeyedJaggedTensor (stride = batch size). Returns [batch, sum(dims)] f32."""
        batch = features.stride()
        if direct.applies(self):
            features = host_copies.to_host(features, "ids")
            out = direct.lookup(self, self._stack_arrays(features)[2], batch)
            if out is not None:
                self._stats_pending = features
                return with_weight_grad(self, features, out)
        return with_weight_grad(self, features, self.lookup(self.preprocess(features), batch))

    def preprocess(self, features: KeyedJaggedTensor) -> list[SparseCoreInput | MultiPassInput]:
        """Host side: one SparseCore input per stack (data-dependent; runs on the CPU).

        Vectorised over features: the KJT is put in stacked order once (a no-op when it already is),
        then each stack's features are one contiguous slice of values and lengths.
        """
        # Preprocessing is host work (data-dependent shapes). Under DMP the ids arrive on the host
        # (tpurec.sharding.host_input_dist); a KJT a caller put on the device is copied back, counted.
        self._stats_pending = None  # this batch's stats replace a direct step's
        features = host_copies.to_host(features, "ids")
        batch, padded, parts = self._stack_arrays(features)
        return self._to_device([self._stack_input(i, *part, batch, padded) for i, part in enumerate(parts)])

    def preprocess_blocks(self, blocks: list) -> list[SparseCoreInput | MultiPassInput]:
        """Several batches of one stride as one step: their lookups stacked along the output's rows
        (block j's rows j x batch ..), one fused update in which every row the blocks touch takes
        its whole gradient once (multipass.stacked_blocks). What a sequence batch over its fixed
        capacity runs as: each block has the fixed shapes, so a TPU reuses the step's programs."""
        inputs, entries = [], []
        for kjt in blocks:
            batch, padded, parts = self._stack_arrays(host_copies.to_host(kjt, "ids"))
            inputs.append([self._stack_input(i, *part, batch, padded) for i, part in enumerate(parts)])
            entries.append([self._stack_entries(i, *part, batch, padded) for i, part in enumerate(parts)])
        out = []
        for i, plan in enumerate(self.stacks):
            d = len(plan.features) * padded
            max_ids, max_uniq = self.stack_limits(i) or (
                self.max_ids_per_partition or d,
                self.max_unique_ids_per_partition or d,
            )
            out.append(
                stacked_blocks(
                    [b[i] for b in inputs],
                    [e[i] for e in entries],
                    device_batch_size=d,
                    num_sc_per_device=self.num_sc,
                    max_ids_per_partition=max_ids,
                    max_unique_ids_per_partition=max_uniq,
                    table_name=plan.layout.name,
                )
            )
            self.last_stats[plan.layout.name].passes = out[-1].passes
        self.multipass_batches += 1
        return self._to_device(out)

    def _stack_arrays(self, features) -> tuple[int, int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
        """(batch, padded batch, per stack its (values, lengths, weights)): the KJT in stacked order,
        cut into one contiguous slice per stack; the batch's demand recorded when asked for."""
        values, lengths, weights = self._stacked_arrays(features)
        batch = features.stride()
        padded = round_up(max(batch, 1), self.num_sc)
        per_slot = lengths.view(-1, batch).sum(1) if batch else torch.zeros(len(self._stacked_order), dtype=torch.long)
        value_offsets = [0] + torch.cumsum(per_slot, 0).tolist()
        if self.table_demand is not None:
            self._record_demand(values, lengths, batch)
        parts, k0 = [], 0
        for plan in self.stacks:
            n = len(plan.features)
            lo, hi = value_offsets[k0], value_offsets[k0 + n]
            parts.append(
                (values[lo:hi], lengths[k0 * batch : (k0 + n) * batch], weights[lo:hi] if weights is not None else None)
            )
            k0 += n
        return batch, padded, parts

    def _to_device(self, csrs: list) -> list:
        device = self.stack_weight(0).device if self.stacks else torch.device("cpu")
        # A kernel on "meta" holds no tables: a preprocessing-only kernel (benchmarks, pipelines
        # sizing buffers), whose inputs stay on the host.
        if device.type not in ("cpu", "meta"):
            csrs = [c.to(device) for c in csrs]
        return csrs

    def _record_demand(self, values, lengths, batch: int) -> None:
        """Each table's demand in this batch, counted as `tpurec data stats` counts it (the table
        alone, its shard's rows, this kernel's SparseCores): the feedback for the next run's limits.
        Per table (by its source name): the four partition / slice figures, the most ids of a
        sample, the batches counted."""
        # a counter per batch size and thread (pipeline workers preprocess side by side; its stamps are its own)
        key = (batch, threading.get_ident())
        counter = self._demand_counters.get(key)
        if counter is None:
            tables = [
                TableShards(
                    name,
                    tuple(f for f in self._stacked_order if self._feature_table[f].name == name),
                    self._table[name].num_embeddings,
                    ((0, self._table[name].num_embeddings),),
                )
                for name in dict.fromkeys(self._feature_table[f].name for f in self._stacked_order)
                # a row-wise shard of a table smaller than the devices holds no rows: no id lands here
                if self._table[name].num_embeddings > 0
            ]
            counter = self._demand_counters[key] = ShardsDemand(
                tables, list(self._stacked_order), num_partitions=self.num_sc, batch=batch
            )
        try:
            figures = counter.count(values.numpy(), lengths.numpy(), batch)
        except UserError:  # an id outside its table: the stack input refuses it, naming the feature
            return
        for t, d in zip(counter.tables, figures):
            k = self._table[t.name]
            seen = self.table_demand.setdefault(k.source or k.name, [0] * 6)  # type: ignore[union-attr]
            seen[:5] = [max(a, b) for a, b in zip(seen[:5], d[:5])]
            seen[5] += 1

    def _record_passes(self, i: int, stats: PreprocessStats) -> None:
        """Per table of stack i (source name): batches its stack ran in several passes, ids its
        stack dropped (shared by the stack's tables)."""
        if self.table_demand is None:
            return
        for name in dict.fromkeys(t for _, t in self.stacks[i].features):
            k = self._table[name]
            seen = self.table_passes.setdefault(k.source or k.name, [0, 0])
            seen[0] += stats.passes > 1
            seen[1] += stats.dropped_id_count

    def lookup(self, csrs: list[SparseCoreInput | MultiPassInput], batch: int) -> torch.Tensor:
        """Device side: pooled embeddings [batch, sum(dims)] ([blocks x batch, ..] for the inputs of
        `preprocess_blocks`); backward applies the fused update."""
        padded = round_up(max(batch, 1), self.num_sc)
        blocks = max((c.blocks for c in csrs if isinstance(c, MultiPassInput)), default=1)
        trigger = _trigger() if torch.is_grad_enabled() else None
        per_stack = []
        for i, (plan, csr) in enumerate(zip(self.stacks, csrs)):
            direct = _writes_final_layout(self.stack_weight(i)) and not isinstance(csr, MultiPassInput)
            out = _FusedLookup.apply(trigger, self, i, csr, batch, direct)
            if direct:
                per_stack.append(out)
                continue
            n, dim, width = len(plan.features), plan.layout.dim, plan.layout.storage_dim
            # [blocks, SparseCores, features, padded / S, width] -> [blocks x batch, features * dim]:
            # one reshape, so backward is one copy (per-feature indexing would cost a full-size zero
            # fill per feature in backward); columns past dim are storage padding to the SparseCore's
            # 8 and are cut here. Blocks: preprocess_blocks' batches, stacked (else one).
            s, m = self.num_sc, blocks
            block = out.view(m, s, n, padded // s, width).transpose(2, 3).reshape(m, padded, n, width)
            per_stack.append(block[:, :batch, :, :dim].reshape(m * batch, n * dim))
        if not self.feature_order:
            return torch.zeros(blocks * batch, 0)
        return self._feature_order_output(per_stack)

    def _feature_order_output(self, per_stack: list[torch.Tensor]) -> torch.Tensor:
        """The stacks' [rows, their features * dim] outputs as one [rows, sum of dims] in feature order."""
        if self._stacked_order == self.feature_order:
            return per_stack[0] if len(per_stack) == 1 else torch.cat(per_stack, dim=1)
        pieces = {}
        for plan, block in zip(self.stacks, per_stack):
            for (f, _), piece in zip(plan.features, block.split(plan.layout.dim, dim=1)):
                pieces[f] = piece
        return torch.cat([pieces[f] for f in self.feature_order], dim=1)

    def _stacked_arrays(self, features):
        """(values, lengths, weights) of the KJT with keys in stacked order, checked."""
        check_kjt(features)
        keys = features.keys()
        if self.positional:
            if len(keys) != len(self.feature_order):
                raise KeyError(f"expected {len(self.feature_order)} features in table order, got keys {keys}")
            perm = self._stacked_positions
        else:
            index = {k: j for j, k in enumerate(keys)}
            missing = [f for f in self.feature_order if f not in index]
            if missing:
                raise KeyError(f"KeyedJaggedTensor lacks features {missing}; it has {keys}")
            perm = [index[f] for f in self._stacked_order]
        if perm != list(range(len(keys))):
            features = features.permute(perm)
        values = features.values()
        if values.is_floating_point() or values.dtype == torch.bool:
            raise TypeError(f"embedding ids must be integers, got dtype {values.dtype}")
        weights = features.weights_or_none()
        if self.is_weighted and weights is None:
            raise UserError("this kernel is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
        # Gains are host data; a trainable weight's gradient comes from weight_grad.with_weight_grad.
        return values, features.lengths(), weights.detach() if self.is_weighted else None

    def _stack_entries(self, i: int, values, lengths, weights, batch: int, padded: int):
        """Stack i's batch as SparseCore entries: (SparseCore ids, device samples, gains), checked."""
        plan, lay = self.stacks[i], self.stacks[i].layout
        offsets, rows, mean = self._stack_tensors[i]
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

    def _stack_input(
        self, i: int, values, lengths, weights, batch: int, padded: int
    ) -> SparseCoreInput | MultiPassInput:
        compiled = self._compiled_stack_input(i, values, lengths, weights, batch, padded)
        if compiled is not None:
            return self._row_slots(i, compiled, values, lengths, weights, batch, padded)
        lay, n = self.stacks[i].layout, len(self.stacks[i].features)
        stacked_ids, samples, gains = self._stack_entries(i, values, lengths, weights, batch, padded)
        common: dict[str, Any] = dict(device_batch_size=n * padded, num_sc_per_device=self.num_sc, table_name=lay.name)
        if not self.fixed_limits:
            max_ids, max_uniq = self.max_ids_per_partition, self.max_unique_ids_per_partition
        else:
            limits = self._stack_limits[i]
            if limits is None:
                _, first = preprocess(stacked_ids, samples, gains, **common)
                max_ids = round_up(max(SEGMENT_ALIGN, 2 * first.max_ids_per_partition), SEGMENT_ALIGN)
                max_uniq = round_up(max(SEGMENT_ALIGN, 2 * first.max_unique_ids_per_partition), SEGMENT_ALIGN)
                limits = self._stack_limits[i] = (max_ids, min(max_uniq, max_ids))
            max_ids, max_uniq = limits
        csr: SparseCoreInput | MultiPassInput
        try:
            csr, stats = preprocess(
                stacked_ids,
                samples,
                gains,
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_uniq,
                allow_id_dropping=self.allow_id_dropping,
                **common,
            )
        except IdLimitExceededError:
            # Over the limits and no dropping asked for: several passes that each fit, equal to the
            # unsplit step (multipass.py); the buffers keep the limits' shapes.
            assert max_ids is not None  # without limits nothing is over them
            _, stats = preprocess(stacked_ids, samples, gains, **common)  # the batch's own demand
            csr = split_into_passes(
                stacked_ids,
                samples,
                gains,
                device_batch_size=n * padded,
                num_sc_per_device=self.num_sc,
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_uniq or max_ids,
                table_name=lay.name,
            )
            stats.passes = csr.passes
            self.multipass_batches += 1
        self.last_stats[lay.name] = stats
        self.dropped_id_count += stats.dropped_id_count
        self._record_passes(i, stats)
        return self._row_slots(i, csr, values, lengths, weights, batch, padded)

    def _row_slots(self, i: int, csr, values, lengths, weights, batch: int, padded: int):
        """With weight decay, the TPU path takes the decay on the device in the shapes of a batch within
        its limits (optimizers/weight_decay.py, `DecayInput`: decoupled, a row scale before the
        ordinary update; L2, one more update entry per row), whether the batch is within its limits
        (the lookup stays `csr`) or over them (its update passes, `MultiPassInput.decays`). Without
        decay, or where the CPU reference has the rows at hand, `csr` as it is."""
        spec = self.optimizer
        if spec.weight_decay_mode is None or _writes_final_layout(self.stack_weight(i)):
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

    def _compiled_stack_input(self, i: int, values, lengths, weights, batch: int, padded: int):
        """The same SparseCore input from the compiled build (`csr_build`), or None: then the torch +
        numpy route below runs, which also owns every error message and the dropping."""
        if values.device.type != "cpu" or not csr_build.available():
            return None
        lay = self.stacks[i].layout
        offsets, rows, mean = self._stack_tensors[i]
        limits = self._stack_limits[i] if self.fixed_limits else None
        if self.fixed_limits and limits is None:
            return None  # the first batch sets fixed limits through the numpy route
        mi, mu = limits if limits is not None else (self.max_ids_per_partition, self.max_unique_ids_per_partition)
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
        stats = PreprocessStats(torch.from_numpy(ids_pp), torch.from_numpy(uniq_pp), need, 0)
        self.last_stats[lay.name] = stats
        self._record_passes(i, stats)
        return csr

    def _raise_bad_ids(self, plan, ids, slot, bad):
        first = int(bad.nonzero()[0])
        f, tname = plan.features[int(slot[first])]
        mine = ids[slot == slot[first]]
        rows = self._table[tname].num_embeddings
        raise IndexError(
            f"feature {f!r} (table {tname!r}): ids must be in [0, {rows}), "
            f"got min {int(mine.min())}, max {int(mine.max())}"
        )

    # -- fused update --------------------------------------------------------------------------
    def apply_update(
        self,
        i: int,
        csr: SparseCoreInput,
        grad: torch.Tensor,
        lr: float,
        new_step: bool = True,
        slot_ids: torch.Tensor | None = None,
    ) -> None:
        """Stack i's fused update: the optimizer spec runs its op on the stack's table and state.
        grad: [device_batch_size, width], or on CPU the [features, batch, dim] view of the kernel's
        output gradient (read in place by the CPU reference, `reference.row_gradients_csr`).
        new_step: False for the later update passes of a step run in several (multipass.py): the
        step count (Adam's bias correction) advances once per step.
        slot_ids: in the one-slot-per-row layout, each slot's row (MultiPassInput.update_ids), which
        weight decay needs."""
        grad = grad.to(torch.float32)
        if grad.dim() == 2:
            grad = grad.contiguous()
        if new_step:
            for hook in self.pre_update_hooks:
                hook()
            self._steps[i] += 1
        states = [self.stack_state(i, s) for s in self.optimizer.state_names]
        if isinstance(csr, DecayInput):  # within its limits, on the TPU path
            csr, grad = apply_decay(self.optimizer, self.stack_weight(i), grad, csr, lr)
        elif self.optimizer.weight_decay_mode is not None:
            weight, dim = self.stack_weight(i), self.stacks[i].layout.dim
            if slot_ids is None:  # the CPU reference: each row and its gradient, decayed, updated
                head = op_head(csr, weight)
                rows, g = ops.row_gradients(*head, grad, *op_tail(csr)[:3])
                g = decay_rows(self.optimizer, weight, g, rows, lr)
                self.optimizer.update_rows(weight, states, rows, g, lr, self._steps[i], dim)
                return
            grad = decay_slots(self.optimizer, weight, grad, slot_ids, lr, self.stacks[i].layout.num_partitions)
        self.optimizer.apply_update(
            csr,
            self.stack_weight(i),
            states,
            grad,
            lr,
            self._steps[i],
            self.computation_names[i],
            dim=self.stacks[i].layout.dim,
        )

    # The learning rate is read at update time from `lr_source`, so torch LR schedulers acting on a
    # FusedOptimizer's param_groups take effect (the fused optimizers bind their group here).
    def current_lr(self) -> float:
        group = self.lr_source
        if group is None:
            return self.optimizer.lr
        lr = float(group["lr"])
        check_hyperparameter(f"{self.optimizer.name} (param_groups)", "lr", lr)  # a scheduler or user may set it
        return lr


def _stack_bound(
    lay: StackLayout, tables: dict, limits: Mapping[str, tuple[int, ...]], num_sc: int
) -> tuple[int, int] | None:
    """Fixed limits for a stack from its tables' measured ones, or None if a table has none.

    Measured per partition of a table alone (C_t rows each); in the stack the tables lie end to end
    and a stack partition (C rows) overlaps at most min(P, ceil(C / C_t) + 1) of a table's own
    partitions, and holds at most the table's whole slice: per table the smaller of the two, summed.
    Exact for a table alone, an upper bound in any stack (a batch over it would still run, in passes).
    """
    from tpurec.embedding.constraints import padded_rows

    ids = uniq = 0
    for ts in lay.tables:
        t = tables[ts.name]
        m = limits.get(t.source or t.name)
        if m is None:
            return None
        own = padded_rows(t.num_embeddings, num_sc) // num_sc
        overlap = 1 if len(lay.tables) == 1 else min(num_sc, -(-lay.rows_per_partition // own) + 1)
        big = 2**31
        ids += min(m[0] * overlap, m[2] if len(m) > 2 else big)
        uniq += min(m[1] * overlap, m[3] if len(m) > 3 else big)
    ids = round_up(max(ids, 1), SEGMENT_ALIGN)
    return ids, min(round_up(max(uniq, 1), SEGMENT_ALIGN), ids)


def stacked_samples(slot: torch.Tensor, b: torch.Tensor, n: int, padded: int, num_sc: int) -> torch.Tensor:
    """Device sample of feature slot k's sample b in a stack of n features: SparseCore c = b div
    (padded / S) holds rows c*n*per .. (c+1)*n*per - 1 (per = padded / S), feature k's at k*per within."""
    per = padded // num_sc
    sc = b // per
    return sc * (n * per) + slot * per + (b - sc * per)


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trigger, kernel: SparseCoreKernel, i: int, csr: SparseCoreInput, batch: int, direct: bool):
        ctx.kernel, ctx.i, ctx.csr, ctx.direct = kernel, i, csr, direct
        weight = kernel.stack_weight(i)
        if ctx.direct:
            ctx.features = len(kernel.stacks[i].features)
            return reference.lookup_csr(
                csr.row_pointers,
                csr.embedding_ids,
                csr.sample_ids,
                csr.gains,
                weight,
                csr.device_batch_size,
                csr.num_sc_per_device,
                csr.num_partitions,
                batch_major=(ctx.features, batch, kernel.stacks[i].layout.dim),
            )
        if isinstance(csr, DecayInput):
            return _lookup_op(csr.lookup, weight)
        if isinstance(csr, MultiPassInput):  # over its limits: the passes' lookups, summed per block
            outs: list[torch.Tensor | None] = [None] * csr.blocks
            for part, b in zip(csr.forward, csr.forward_blocks or [0] * len(csr.forward)):
                o = _lookup_op(part, weight)
                outs[b] = o if outs[b] is None else outs[b] + o
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return _lookup_op(csr, weight)

    @staticmethod
    def backward(ctx, grad):
        kernel, csr = ctx.kernel, ctx.csr
        if ctx.direct:  # [batch, n * dim]: the CPU reference reads it in place
            grad = reference.batch_major_grad(grad, ctx.features)
        lr = kernel.current_lr()
        if isinstance(csr, MultiPassInput):  # each row once, with its whole gradient
            grad = grad.to(torch.float32)
            decays, l2 = csr.decays, kernel.optimizer.weight_decay_mode == "L2"
            if decays is not None and not l2:  # decoupled on the TPU path: the rows scaled once, first
                apply_decay(kernel.optimizer, kernel.stack_weight(ctx.i), grad, decays[0], lr)
            for p, part in enumerate(csr.updates):
                g = csr.update_gradient(p, grad)
                if decays is not None:  # L2: the pass with its rows' decay entries; decoupled: done
                    step = decays[p] if l2 else DecayInput(part, part, [])
                    kernel.apply_update(ctx.i, step, g, lr, new_step=p == 0)
                    continue
                slots = csr.update_ids[p] if csr.update_ids else None  # the CPU reference's decay
                kernel.apply_update(ctx.i, part, g, lr, new_step=p == 0, slot_ids=slots)
        else:
            kernel.apply_update(ctx.i, csr, grad, lr)
        return None, None, None, None, None, None


def _lookup_op(csr: SparseCoreInput, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.tpurec.sparse_dense_matmul(
        csr.row_pointers,
        csr.embedding_ids,
        csr.sample_ids,
        csr.gains,
        weight,
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
        csr.max_ids_per_partition,
        csr.max_unique_ids_per_partition,
    )
