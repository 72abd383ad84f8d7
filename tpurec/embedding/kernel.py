"""SparseCoreKernel: the embedding bags of one device, in the SparseCore layout, with the fused update.

The building block shared by the standalone `SparseCoreEmbeddingBagCollection` and by the sharded
lookups under `DistributedModelParallel`. It takes a KeyedJaggedTensor and returns the pooled
embeddings [batch, sum of dims] in feature order; backward through that output runs the fused
optimizer update op of every stack, in place, without materialising a dense table gradient.

The kernel keeps the tables' storage, the lookup and the update; its host half, `inputs`
(kernel_input.py), turns a batch into one SparseCore input per stack (tables of one dim stored
together). The stacked batch is interleaved per SparseCore, as TorchTPU's preprocessing lays it out
(torchrec `experimental/torch_tpu/modules/fused_embedding_modules.py`, `_unstack_activation`: the
op's rows are [SparseCores, features, B'/S, dim]): SparseCore c's slice holds samples
c*B'/S..(c+1)*B'/S-1 of every feature (B' = batch padded to a multiple of the SparseCore count S),
so each SparseCore gets 1/S of every feature's ids. (Feature-major slices gave one SparseCore whole
features: on the MLPerf stack 56% of the ids and 4x the CSR buffers.) Ids are shifted by their
table's offset in the stack, and gains carry per-id weights and the 1/bag-length of mean pooling.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from tpurec.embedding import custom_ops, direct, dtypes, huge_pages, ops, reference, step_scalars  # noqa: F401  (ops registers torch.ops.tpurec.*)
from tpurec.embedding.constraints import round_up
from tpurec.embedding.cpu_path import grad_trigger as _trigger
from tpurec.embedding.cpu_path import writes_final_layout as _writes_final_layout
from tpurec.embedding.kernel_input import KernelInput, StackInput, StackPlan
from tpurec.embedding.kernel_table import KernelTable, index_tables
from tpurec.embedding.layout import StackLayout
from tpurec.embedding.multipass import MultiPassInput
from tpurec.embedding.optimizers.base import OptimizerSpec, check_hyperparameter, op_head, op_tail
from tpurec.embedding.optimizers.weight_decay import DecayInput, apply_decay, decay_rows, decay_slots
from tpurec.embedding.preprocess import PreprocessStats, SparseCoreInput
from tpurec.embedding.settings import KernelSettings
from tpurec.embedding.weight_grad import with_weight_grad
from tpurec.errors import UserError
from tpurec.runtime import host_copies
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.host_tier.table_tier import TableTier

__all__ = ["KernelTable", "SparseCoreKernel"]

# Kernel numbers for computation names: unique within the process, fixed for a kernel's lifetime.
_KERNEL_NUMBERS = itertools.count()


class SparseCoreKernel(nn.Module):
    # Set by custom_ops.prepare: the kernel's key in the compiled ops' arguments, and their grad trigger.
    custom_op_key: int
    custom_op_trigger: torch.Tensor
    # The tables kept in host memory behind a cache of their rows, by table name (host_tier/kernel.py's
    # subclass sets it); None: every table resident.
    host_tier: dict[str, TableTier] | None = None

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

        A stack whose tables all have id_limits gets fixed limits that bound every segment
        (`stack_limits.stack_bound`). With fixed limits, limits come from max_ids_per_partition /
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
        self._check_arguments(num_sc_per_device, optimizer)
        self.tables = list(tables)
        self.optimizer = optimizer
        self.num_sc = num_sc_per_device
        self.is_weighted = is_weighted
        self.max_ids_per_partition = self.settings.max_ids_per_partition
        self.max_unique_ids_per_partition = self.settings.max_unique_ids_per_partition
        self.allow_id_dropping = self.settings.allow_id_dropping
        self._table, self._feature_table = index_tables(self.tables)
        self.inputs = KernelInput(
            self.tables,
            self._stored_dtypes(device),
            num_sc=num_sc_per_device,
            settings=self.settings,
            optimizer=optimizer,
            is_weighted=is_weighted,
            positional=positional,
            storage=self.stack_weight,
        )
        # Output order = EBC's: tables in order, each table's features in order.
        self.feature_order = self.inputs.feature_order
        self.feature_dims = [self._feature_table[f].embedding_dim for f in self.feature_order]
        self.stacks: list[StackPlan] = self.inputs.stacks
        self._stack_of = {ts.name: i for i, plan in enumerate(self.stacks) for ts in plan.layout.tables}
        self._init_update_state()
        self._allocate_storage(device)
        self._allocate_step_feed(device)
        self.reset_parameters()
        custom_ops.prepare(self)  # what a compiled lookup needs (custom_ops.py)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        custom_ops.prepare(self)  # a copy (deepcopy, pickle) is a kernel of its own to the ops

    def _check_arguments(self, num_sc_per_device: int, optimizer: OptimizerSpec) -> None:
        if num_sc_per_device < 1:
            raise UserError(f"num_sc_per_device must be >= 1, got {num_sc_per_device}")
        if self.settings.allow_id_dropping and optimizer.weight_decay_mode is not None:
            # The decay's update layout takes every id of the batch; a lookup that dropped some would
            # update rows it never read. Over its limits such a batch runs in passes instead.
            raise UserError(
                f"allow_id_dropping=True with weight decay ({optimizer.weight_decay_mode}) is not supported: "
                "leave allow_id_dropping off (a batch over its id limits then runs in several passes)"
            )

    def _stored_dtypes(self, device: torch.device) -> dict[str, torch.dtype]:
        """Each table's storage dtype on `device` (quantized dtypes refused, widened ones warned of)."""
        for t in self.tables:
            dtypes.table_dtype(t.dtype, t.name)  # refuses quantized dtypes
        stored = {t.name: dtypes.stored_dtype(t.dtype, device.type, self.settings.widen_tables) for t in self.tables}
        dtypes.warn_widened({t.source or t.name: t.dtype for t in self.tables if stored[t.name] != t.dtype})
        return stored

    def _init_update_state(self) -> None:
        # Optimizer steps taken per stack (Adam's bias correction); stacks update independently
        # because autograd may run their backward in any order. Public per table: step_count().
        self._steps = [0] * len(self.stacks)
        # Called before every fused update: fused optimizers pass on step counts written into their
        # checkpointed scalars in place (DCP's load), which no load_state_dict call announces.
        self.pre_update_hooks: list[Callable[[], None]] = []
        # The param group whose "lr" every update reads (see current_lr); None: the spec's lr.
        self.lr_source: dict[str, Any] | None = None
        # The group's lr as its fused optimizer last handed it over (`latch_lr`): what an eager
        # forward's update uses (`forward_lr`); None until a fused optimizer binds the kernel.
        self.latched_lr: float | None = None
        self.lr_at_update = False  # True: every update reads the group's lr then (compiled, pipelined steps)
        # One name per stack for TorchTPU's update ops, unique in the process and the same every step:
        # TorchTPU reuses a function by name inside one program, so stacks must not share one, and a
        # name that changed per step would compile a new program each time.
        number = next(_KERNEL_NUMBERS)
        self.computation_names = [
            f"tpurec_k{number}_{re.sub(r'[^0-9A-Za-z_]', '_', plan.layout.name)}_{self.optimizer.name}"
            for plan in self.stacks
        ]

    def _allocate_storage(self, device: torch.device) -> None:
        # Physical storage: one partition-major table per stack plus its optimizer state. Buffers
        # (not parameters): a dense optimizer must never touch them; state_dict hooks of the owning
        # module expose them per table in natural row order.
        for i, plan in enumerate(self.stacks):
            lay = plan.layout
            # on the host: huge pages where Linux grants them (random rows of a large table otherwise
            # miss the TLB too; huge_pages.py)
            table = huge_pages.filled((lay.total_rows, lay.storage_dim), 0.0, lay.dtype, device)
            self.register_buffer(f"weight_{i}", table, persistent=False)
            for s in self.optimizer.state_names:  # float32 whatever the table's dtype, as FBGEMM keeps it
                shape = self.optimizer.state_shape(s, lay.total_rows, lay.storage_dim)
                init = self.optimizer.initial_value(s)
                state = huge_pages.filled(tuple(shape), init, torch.float32, device)
                self.register_buffer(f"{s}_{i}", state, persistent=False)

    def _allocate_step_feed(self, device: torch.device) -> None:
        # A compiled step's scalars, one row per stack (step_scalars.py): an input of its graph, written
        # before each step by begin_compiled_step. A plain attribute, not a buffer: no state, nothing a
        # module walk (DDP's buffer broadcast, state_dict) should see.
        n = len(self.optimizer.device_scalars(1.0, 1, 8, 8))
        self.step_feed = torch.zeros((len(self.stacks), n), dtype=torch.float32, device=device)
        # (the group's lr, the row's values by name) of the step begun last, per stack; None before one
        self.step_feed_values: list[tuple[float, dict[str, float]] | None] = [None] * len(self.stacks)

    def begin_compiled_step(self) -> None:
        """Before a compiled training step (its eager half, after `preprocess`): count the step of every
        stack and write the update's scalars at the param group's lr into `step_feed`, which the graph
        takes as an input, as its update ops cannot read Python state on a TPU (step_scalars.py)."""
        lr = self.current_lr()
        rows = []
        for i, plan in enumerate(self.stacks):
            for hook in self.pre_update_hooks:  # as apply_update runs them at a new step
                hook()
            self._steps[i] += 1
            width = self.stack_weight(i).shape[1]
            values = self.optimizer.device_scalars(lr, self._steps[i], width, plan.layout.dim)
            self.step_feed_values[i] = (lr, values)
            rows.append(step_scalars.host_row(values))
        if rows:
            self.step_feed.copy_(torch.stack(rows))  # one host->device copy a step

    def take_step_feed(self, i: int) -> tuple[float, dict[str, float]]:
        """Stack i's (lr, scalars) of the step `begin_compiled_step` began last (none begun: refused)."""
        begun = self.step_feed_values[i]
        if begun is None:
            raise RuntimeError(
                "a compiled step's update ran without SparseCoreKernel.begin_compiled_step() before it (the "
                "step's count and scalars, step_scalars.py): call it in the eager half of every compiled step"
            )
        return begun

    # -- the input half's figures (kernel_input.py), read and set here as before -----------------
    @property
    def last_stats(self) -> dict[str, PreprocessStats]:
        """PreprocessStats of the last batch per stack (built on demand after a direct step)."""
        return self.inputs.stats()

    @property
    def fixed_limits(self) -> bool:
        return self.inputs.fixed_limits

    def stack_limits(self, i: int) -> tuple[int, int] | None:
        """Stack i's fixed (max ids, max unique ids) per partition; None until set (or when not fixed)."""
        return self.inputs.stack_limits(i)

    def set_stack_limits(self, i: int, limits: tuple[int, int]) -> None:
        """Fix stack i's limits (KernelInput.set_stack_limits: the ranks' alignment, rank_limits.py)."""
        self.inputs.set_stack_limits(i, limits)

    @property
    def dropped_id_count(self) -> int:
        return self.inputs.dropped_id_count

    @property
    def multipass_batches(self) -> int:
        """Stack inputs run as several passes (over their limits)."""
        return self.inputs.multipass_batches

    @property
    def table_demand(self) -> dict[str, list[int]] | None:
        """{} to record every table's demand per batch (KernelInput.table_demand); None: off."""
        return self.inputs.table_demand

    @table_demand.setter
    def table_demand(self, value: dict[str, list[int]] | None) -> None:
        self.inputs.table_demand = value

    @property
    def table_passes(self) -> dict[str, list[int]]:
        """With table_demand: per table, [multipass batches, dropped ids]."""
        return self.inputs.table_passes

    def preprocess(self, features: KeyedJaggedTensor) -> list[StackInput]:
        """Host side: one SparseCore input per stack (KernelInput.preprocess)."""
        return self.inputs.preprocess(features)

    def preprocess_blocks(self, blocks: list[KeyedJaggedTensor]) -> list[StackInput]:
        """Several batches of one stride as one step (KernelInput.preprocess_blocks)."""
        return self.inputs.preprocess_blocks(blocks)

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

    def table_of(self, feature: str) -> KernelTable | None:
        """The table feature `feature` feeds (None: none of this kernel's)."""
        return self._feature_table.get(feature)

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
            if view.device.type == DeviceKind.CPU:  # in place: no second copy of a large table, same draws
                view.uniform_(lo, hi)
            else:  # drawn on the host so that a TPU run starts from the CPU run's tables
                view.copy_(torch.empty(t.num_embeddings, t.embedding_dim).uniform_(lo, hi))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """features: KeyedJaggedTensor (stride = batch size). Returns [batch, sum(dims)] f32."""
        batch = features.stride()
        if direct.applies(self):
            features = host_copies.to_host(features, "ids")
            out = direct.lookup(self, direct.host_parts(self, features, batch), batch)
            if out is not None:
                self.inputs.stats_pending = features
                return with_weight_grad(self, features, out)
        # the input half itself: a subclass's `preprocess` takes a batch before forward has prepared it
        # (host_tier/kernel.py maps its ids to cache slots there and here, once)
        return with_weight_grad(self, features, self.lookup(self.inputs.preprocess(features), batch))

    def lookup(self, csrs: list[StackInput], batch: int) -> torch.Tensor:
        """Device side: pooled embeddings [batch, sum(dims)] ([blocks x batch, ..] for the inputs of
        `preprocess_blocks`); backward applies the fused update."""
        # a plain loop: torch 2.13's Dynamo (the chip's) refuses max() over a generator with a default
        blocks = 1
        for c in csrs:
            if isinstance(c, MultiPassInput):
                blocks = max(blocks, c.blocks)
        compiling = torch.compiler.is_compiling()  # the ops with registered autograd (custom_ops.py)
        trigger = None
        if torch.is_grad_enabled():
            trigger = self.custom_op_trigger if compiling else _trigger()
        per_stack = []
        for i, (_, csr) in enumerate(zip(self.stacks, csrs)):
            direct = _writes_final_layout(self.stack_weight(i)) and not isinstance(csr, MultiPassInput)
            if compiling:
                out = custom_ops.stack_lookup(self, trigger, i, csr)
            else:
                out = _FusedLookup.apply(trigger, self, i, csr, batch, direct)
            per_stack.append(out if direct else self._stack_block(i, out, batch, blocks))
        if not self.feature_order:
            return torch.zeros(blocks * batch, 0)
        return self._feature_order_output(per_stack)

    def assemble(self, raw: list[torch.Tensor], batch: int) -> torch.Tensor:
        """`lookup`'s output from each stack's lookup-op output ([device batch, width], one block):
        [batch, sum(dims)], differentiable back to `raw` (a pipelined step's activations,
        tpurec/sharding/step/pipelined.py)."""
        if not self.feature_order:
            return torch.zeros(batch, 0)
        return self._feature_order_output([self._stack_block(i, out, batch, 1) for i, out in enumerate(raw)])

    def _stack_block(self, i: int, out: torch.Tensor, batch: int, blocks: int) -> torch.Tensor:
        """Stack i's op output as [blocks x batch, its features * dim]."""
        plan, padded = self.stacks[i], round_up(max(batch, 1), self.num_sc)
        n, dim, width = len(plan.features), plan.layout.dim, plan.layout.storage_dim
        # [blocks, SparseCores, features, padded / S, width] -> [blocks x batch, features * dim]:
        # one reshape, so backward is one copy (per-feature indexing would cost a full-size zero
        # fill per feature in backward); columns past dim are storage padding to the SparseCore's
        # 8 and are cut here. Blocks: preprocess_blocks' batches, stacked (else one).
        s, m = self.num_sc, blocks
        block = out.view(m, s, n, padded // s, width).transpose(2, 3).reshape(m, padded, n, width)
        return block[:, :batch, :, :dim].reshape(m * batch, n * dim)

    def _feature_order_output(self, per_stack: list[torch.Tensor]) -> torch.Tensor:
        """The stacks' [rows, their features * dim] outputs as one [rows, sum of dims] in feature order."""
        if self.inputs.stacked_order == self.feature_order:
            return per_stack[0] if len(per_stack) == 1 else torch.cat(per_stack, dim=1)
        pieces = {}
        for plan, block in zip(self.stacks, per_stack):
            for (f, _), piece in zip(plan.features, block.split(plan.layout.dim, dim=1)):
                pieces[f] = piece
        return torch.cat([pieces[f] for f in self.feature_order], dim=1)

    # -- fused update --------------------------------------------------------------------------
    def apply_update(
        self,
        i: int,
        csr: SparseCoreInput,
        grad: torch.Tensor,
        lr: float,
        new_step: bool = True,
        slot_ids: torch.Tensor | None = None,
        storage: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> None:
        """Stack i's fused update: the optimizer spec runs its op on the stack's table and state.
        grad: [device_batch_size, width], or on CPU the [features, batch, dim] view of the kernel's
        output gradient (read in place by the CPU reference, `reference.row_gradients_csr`).
        new_step: False for the later update passes of a step run in several (multipass.py): the
        step count (Adam's bias correction) advances once per step.
        slot_ids: in the one-slot-per-row layout, each slot's row (MultiPassInput.update_ids), which
        weight decay needs.
        storage: (table, state tensors) to update in place of the stack's own (a compiled step's
        copies of them, custom_ops.py)."""
        grad = grad.to(torch.float32)
        if grad.dim() == 2:
            grad = grad.contiguous()
        if new_step:
            for hook in self.pre_update_hooks:
                hook()
            self._steps[i] += 1
        weight, states = storage or (self.stack_weight(i), [self.stack_state(i, s) for s in self.optimizer.state_names])
        if isinstance(csr, DecayInput):  # within its limits, on the TPU path
            csr, grad = apply_decay(self.optimizer, weight, grad, csr, lr)
        elif self.optimizer.weight_decay_mode is not None:
            dim = self.stacks[i].layout.dim
            if slot_ids is None:  # the CPU reference: each row and its gradient, decayed, updated
                head = op_head(csr, weight)
                rows, g = ops.row_gradients(*head, grad, *op_tail(csr)[:3])
                g = decay_rows(self.optimizer, weight, g, rows, lr)
                self.optimizer.update_rows(weight, states, rows, g, lr, self._steps[i], dim)
                return
            grad = decay_slots(self.optimizer, weight, grad, slot_ids, lr, self.stacks[i].layout.num_partitions)
        self.optimizer.apply_update(
            csr,
            weight,
            states,
            grad,
            lr,
            self._steps[i],
            self.computation_names[i],
            dim=self.stacks[i].layout.dim,
        )

    # The learning rate is read at update time from `lr_source`, so torch LR schedulers acting on a
    # FusedOptimizer's param_groups take effect (the fused optimizers bind their group here): the
    # compiled and pipelined steps' updates read it so.
    def current_lr(self) -> float:
        group = self.lr_source
        if group is None:
            return self.optimizer.lr
        lr = float(group["lr"])
        check_hyperparameter(f"{self.optimizer.name} (param_groups)", "lr", lr)  # a scheduler or user may set it
        return lr

    def latch_lr(self) -> None:
        """Take the group's lr now, as stock TorchRec's fused optimizer hands it to FBGEMM
        (`set_learning_rate`) at its construction, `zero_grad()` and `step()`."""
        # checked when a forward takes it (forward_lr): zero_grad() refuses nothing, as stock's
        self.latched_lr = float(self.lr_source["lr"]) if self.lr_source is not None else None

    def forward_lr(self) -> float:
        """The lr the update of a forward run now uses (the eager path): the one latched last, as stock's
        FBGEMM CPU update uses the learning rate its module held when the forward ran, so a scheduler
        stepped, or a group lr set, between the fused optimizer's step() / zero_grad() and the
        forward waits for the next of those calls (issue 63 item 6); the group's lr now when unbound."""
        if self.latched_lr is None or self.lr_at_update:
            return self.current_lr()
        check_hyperparameter(f"{self.optimizer.name} (param_groups)", "lr", self.latched_lr)
        return self.latched_lr


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        trigger: torch.Tensor | None,
        kernel: SparseCoreKernel,
        i: int,
        csr: SparseCoreInput,
        batch: int,
        direct: bool,
    ) -> torch.Tensor:
        ctx.kernel, ctx.i, ctx.csr, ctx.direct = kernel, i, csr, direct
        ctx.lr = kernel.forward_lr()  # the update's lr: fixed when the forward runs, as stock's
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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        kernel, csr = ctx.kernel, ctx.csr
        if ctx.direct:  # [batch, n * dim]: the CPU reference reads it in place
            grad = reference.batch_major_grad(grad, ctx.features)
        lr = ctx.lr
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
