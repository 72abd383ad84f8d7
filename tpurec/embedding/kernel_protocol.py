"""EmbeddingKernel: what the rest of tpurec uses of an embedding kernel, and nothing more.

The sharded lookups (tpurec/sharding/) and embedding/'s helpers (the fused optimizer, the custom
ops, the weights' gradient) speak to a kernel only through these protocols; which class implements
them is picked in one place (kernel_kinds.py). The SparseCore kernel (kernel.py, sequence_kernel.py)
implements them; the TensorCore kernel (tensorcore/, for TPUs without SparseCore) shares its host
half and brings its own device kernels for the ops, one entry in kernel_kinds.py.

A leaf: it imports data types only (for annotations), never a kernel, so that the kernel's own
modules (custom_ops.py, weight_grad.py import it) and the sharded lookups can both name it.
Members are listed by what their callers do with them; each says who reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.host_tier.table_tier import TableTier
    from tpurec.embedding.kernel_input import KernelInput, StackInput, StackPlan
    from tpurec.embedding.kernel_table import KernelTable
    from tpurec.embedding.optimizers.base import OptimizerSpec
    from tpurec.embedding.sequence_inputs import SequenceInputs
    from tpurec.embedding.settings import KernelSettings


class EmbeddingKernel(Protocol):
    """A pooled kernel: one device's tables, its lookup [batch, sum of dims] and fused update."""

    # -- the lookup: host half, device half, and the device half's output from raw activations --
    def __call__(self, features: KeyedJaggedTensor) -> torch.Tensor: ...

    def preprocess(self, features: KeyedJaggedTensor) -> list[StackInput]: ...

    def lookup(self, csrs: list[StackInput], batch: int) -> torch.Tensor: ...

    def assemble(self, raw: list[torch.Tensor], batch: int) -> torch.Tensor: ...

    @property
    def is_weighted(self) -> bool: ...  # whether per-id weights scale the lookup (weighted EBCs)

    # what the weights' gradient reads (weight_grad.py): output columns and each feature's table
    @property
    def positional(self) -> bool: ...

    @property
    def feature_order(self) -> list[str]: ...

    @property
    def feature_dims(self) -> list[int]: ...

    def table_of(self, feature: str) -> KernelTable | None: ...

    # -- tables and optimizer state in natural row order (state_dict, checkpoints, evictions) ----
    @property
    def table_names(self) -> list[str]: ...

    def read_weight(self, table: str) -> torch.Tensor: ...

    def write_weight(self, table: str, value: torch.Tensor) -> None: ...

    def read_state(self, table: str, name: str) -> torch.Tensor: ...

    def write_state(self, table: str, name: str, value: torch.Tensor) -> None: ...

    # tables kept in host memory behind a cache of their rows (host_tier/), by table name; None: all
    # resident. Their inputs depend on the cache at step time: the sharded lookups build none ahead.
    host_tier: dict[str, TableTier] | None

    # -- the fused optimizer (fused_optimizer.py binds its param group and step counts) ---------
    @property
    def optimizer(self) -> OptimizerSpec: ...

    lr_source: dict[str, Any] | None  # the param group whose "lr" every update reads
    latched_lr: float | None  # its lr when the fused optimizer last handed it over (latch_lr)
    lr_at_update: bool  # every update reads lr_source's lr when it runs, not latched_lr

    @property
    def pre_update_hooks(self) -> list[Callable[[], None]]: ...

    def current_lr(self) -> float: ...

    def latch_lr(self) -> None: ...

    def forward_lr(self) -> float: ...

    def step_count(self, table: str) -> int: ...

    def set_step_count(self, table: str, n: int) -> None: ...

    # -- stacks: the compiled and pipelined steps' per-stack ops (custom_ops.py) -----------------
    @property
    def stacks(self) -> list[StackPlan]: ...

    @property
    def inputs(self) -> KernelInput: ...  # the host half (a feature processor's gains read its arrays)

    def stack_weight(self, i: int) -> torch.Tensor: ...

    def stack_state(self, i: int, name: str) -> torch.Tensor: ...

    @property
    def custom_op_key(self) -> int: ...

    @property
    def custom_op_trigger(self) -> torch.Tensor: ...

    # -- a compiled step's update scalars (step_scalars.py) ------------------------------------------
    step_feed: torch.Tensor

    def begin_compiled_step(self) -> None: ...

    def take_step_feed(self, i: int) -> tuple[float, dict[str, float]]: ...

    # -- stack limits: fixed ones are graph constants, so the ranks align them (rank_limits.py) --
    @property
    def fixed_limits(self) -> bool: ...

    def stack_limits(self, i: int) -> tuple[int, int] | None: ...

    def set_stack_limits(self, i: int, limits: tuple[int, int]) -> None: ...


class SequenceEmbeddingKernel(EmbeddingKernel, Protocol):
    """An unpooled kernel: one row per id, [ids, dim] (the sharded EmbeddingCollection's lookups)."""

    @property
    def dim(self) -> int: ...  # every table's (one dim per sequence kernel)

    def preprocess_sequence(self, features: KeyedJaggedTensor) -> SequenceInputs: ...

    def lookup_sequence(self, inputs: SequenceInputs) -> torch.Tensor: ...


class KernelFactory(Protocol):
    """A kernel class as kernel_kinds.py hands it out: built from the device's tables and optimizer."""

    def __call__(
        self,
        tables: Sequence[KernelTable],
        optimizer: OptimizerSpec,
        num_sc_per_device: int,
        *,
        device: torch.device | str | None = None,
        positional: bool = False,
        settings: KernelSettings | None = None,
        **keywords: Any,
    ) -> EmbeddingKernel: ...


class SequenceKernelFactory(Protocol):
    """The same for an unpooled kernel."""

    def __call__(
        self,
        tables: Sequence[KernelTable],
        optimizer: OptimizerSpec,
        num_sc_per_device: int,
        *,
        device: torch.device | str | None = None,
        positional: bool = False,
        settings: KernelSettings | None = None,
        **keywords: Any,
    ) -> SequenceEmbeddingKernel: ...
