"""KernelSettings: the SparseCore kernel's buffer and layout settings, as one frozen object.

Built once where the options are known (the modules from their keywords, the sharders from theirs,
DistributedModelParallel from `id_limits`) and handed whole to SparseCoreKernel; the sharders carry
it in their fused params (`SETTINGS_KEY`), which TorchRec hands to every table's kernel module.
Settings left as None are decided by the storage device, in one place: `resolved_for`.

`TableLimits`: one table's measured id limits (`tpurec data stats`, docs/id_limits.md), by name;
`KernelSettings.id_limits` maps table names to them from the limits file to the kernel.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from tpurec.errors import UserError

# The fused-params key the sharders carry their KernelSettings under (tpurec.sharding.sharder).
SETTINGS_KEY = "sparsecore_settings"
# The most ids a limit can name: the kernel's buffers index ids and entries as int32 on the SparseCore
# (tpurec/planner/id_limits.py bounds limits files by the same figure).
MAX_ID_LIMIT = 2**31 - 1
# The largest stack the TensorCore kernel keeps on a TPU: its updates return a new stack that is copied
# back, so the largest stack's rows are held twice for a moment. One 6.3 GiB stack of MLPerf DLRM-DCNv2's
# 26 tables (2M-row caps) failed that way on a v5e's 16 GiB; 1 GiB keeps the transient at 1/16 of the
# chip (docs/results.md, 2026-12-06; docs/tensorcore.md).
TENSORCORE_MAX_STACK_BYTES = 1 << 30
# The first batch's limits, over its own counts: twice them (SparseCore partitions), or 10% more on the
# TensorCore kernel, whose lookup and update work on every slot of the buffers: with twice the ids, MLPerf
# DLRM-DCNv2's step on v5e spent 530 ms in the update and 154 ms in the lookup over 5.9M slots holding
# 3.0M ids (docs/results.md, session 31). 10% is `tpurec data stats`' headroom (planner/id_limits.py).
FIRST_BATCH_HEADROOM = 1.0
FIRST_BATCH_HEADROOM_TENSORCORE = 0.10
# The first batch's distinct ids, under a headroom below FIRST_BATCH_HEADROOM (the TensorCore kernel, whose
# update's optimizer works on as many rows as that limit allows: at 2x, 740k rows for 370k distinct in
# MLPerf's largest stack, 29 of its 65 ms on v5e, docs/results.md session 32): the same headroom, or
# UNIQUE_SIGMAS standard deviations of a count that varies as a Poisson count does (sqrt of itself) where
# that is more, so a small batch's distinct count (100 +- 10) keeps room; at most twice them.
UNIQUE_SIGMAS = 6.0


def _whole_limit(where: str, value: object) -> int:
    """One limit: a whole number in [1, MAX_ID_LIMIT]. A bool, a string ("8"), a float (NaN, 8.5) or a
    number out of range is refused naming `where`: int() took "8", truncated 8.5 and raised a bare
    ValueError on NaN, and 0 or -8 were kept and failed inside the kernel."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= MAX_ID_LIMIT:
        raise UserError(f"{where}: {value!r} is not a whole number in [1, {MAX_ID_LIMIT:,}]")
    return int(value)


@dataclass(frozen=True)
class TableLimits:
    """One table's measured id limits (the fields of a limits file's table entry). Frozen and
    hashable: they travel in the sharders' fused params, which TorchRec groups tables by hashing."""

    max_ids_per_partition: int
    """Ids one partition of the table alone held (its rows MOD-partitioned over the SparseCores)."""

    max_unique_ids_per_partition: int
    """Distinct ids one partition of the table alone held."""

    max_ids_per_slice: int | None = None
    """Ids of one SparseCore's sample slice (what a stack partition holding all of the table gets);
    given with max_unique_ids_per_slice or not at all. None: not measured (no bound beyond the
    per-partition figures)."""

    max_unique_ids_per_slice: int | None = None
    """Distinct ids of one SparseCore's sample slice. None: not measured."""

    max_ids_per_feature: int | None = None
    """The most ids one feature had in a batch: a sequence table's capacity. None: not measured."""

    def __post_init__(self) -> None:
        for i, f in enumerate(fields(self)):
            value = getattr(self, f.name)
            if value is not None or i < 2:  # the per-partition pair is required; the others optional
                object.__setattr__(self, f.name, _whole_limit(f"TableLimits {f.name}", value))
        if (self.max_ids_per_slice is None) != (self.max_unique_ids_per_slice is None):
            raise UserError(f"TableLimits: the per-slice limits come in pairs, got {self!r}")

    @classmethod
    def from_positions(cls, values: Sequence[int]) -> TableLimits:
        """From the positional form the public APIs still take and plan files store: (max ids, max
        unique ids per partition[, per slice (2)[, per feature]])."""
        if len(values) not in (2, 4, 5):
            raise UserError(
                f"{tuple(values)!r} is not (max ids, max unique ids per partition"
                "[, max ids, max unique ids per slice[, max ids per feature]])"
            )
        return cls(*values)  # each checked (and made an int) by __post_init__

    def positions(self) -> tuple[int, ...]:
        """The positional form (`from_positions`): what plan files store."""
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)


class _TableLimitsByName(Mapping[str, TableLimits]):
    """KernelSettings.id_limits as stored: a read-only mapping that hashes, so the settings
    holding it can be a fused param (TorchRec groups tables by hashing fused params)."""

    def __init__(self, items: Iterable[tuple[str, TableLimits]]) -> None:
        self._items = dict(items)

    def __getitem__(self, name: str) -> TableLimits:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


@dataclass(frozen=True)
class KernelSettings:
    max_ids_per_partition: int | None = None
    """Ids one SparseCore partition's buffer holds. Default None: fixed from the first batch (fixed
    limits) or sized to each batch."""

    max_unique_ids_per_partition: int | None = None
    """Distinct ids one partition's buffer holds. Default None: max_ids_per_partition."""

    allow_id_dropping: bool = False
    """Drop the ids over the limits (counted in dropped_id_count) instead of running the batch in
    several passes. Default False."""

    stack_tables: bool = True
    """Store tables of one dim in one stacked table (one op per stack). Default True."""

    fixed_limits: bool | None = None
    """Keep each stack's id limits (and every buffer shape) the same for every batch. Default None:
    on when id_limits are given, else on where the tables are stored on a TPU (TorchTPU compiles
    the limits into the program, so limits sized to each batch would recompile every step);
    elsewhere limits left as None follow each batch."""

    pad_dims: bool | None = None
    """Store rows padded to 8 floats, as the SparseCore needs (layout.py). Default None: on a TPU
    device only; tests force it on CPU to exercise the padded path."""

    widen_tables: bool | None = None
    """Store FP16/BF16 tables as float32, with one warning naming them. Default None: on a TPU device
    only, where TorchTPU's SparseCore ops take float32 tables (`tpurec.embedding.dtypes`). Otherwise
    each table is stored in its dtype and updated in float32, rounded once per step."""

    max_ids_per_feature: int | None = None
    """Sequence tables (SparseCoreSequenceKernel) only: the ids one feature holds in a batch, the
    fixed capacity a TPU's buffers are sized for. Default None: the measured
    `TableLimits.max_ids_per_feature` when every table has one, else twice the first batch's
    largest feature (fixed limits) or each batch's own. Bag kernels ignore it."""

    max_stack_bytes: int | None = None
    """The most bytes one stack's stored rows take: tables of one dim and dtype beyond it go to further
    stacks (layout.build_stacks). Default None: TENSORCORE_MAX_STACK_BYTES where the TensorCore
    kernel runs on a TPU (v5e, v4), whose updates write a new stack and copy it back, so that a stack
    briefly takes twice its memory; elsewhere no bound."""

    first_batch_headroom: float | None = None
    """With fixed limits and none given or measured, the first batch sets them: its fullest partition's
    ids times 1 + this, 8-aligned (its distinct ids: twice them under the SparseCore default, they vary
    more from batch to batch; under a smaller headroom the same headroom, or UNIQUE_SIGMAS Poisson
    deviations where that is more, at most twice: the TensorCore update's optimizer works on that many
    rows a partition; `kernel_input.unique_factor`; at most the ids'); a later batch over them runs in
    passes (exact, slower).
    Default None: FIRST_BATCH_HEADROOM_TENSORCORE where the TensorCore kernel runs on a TPU (one
    partition a stack: its ids per batch are a sum over every sample and vary little, and the lookup and
    the update's gradient merge work on every slot, padding or not), else FIRST_BATCH_HEADROOM (a
    SparseCore partition's share of a batch varies more)."""

    id_limits: Mapping[str, TableLimits] | None = None
    """Measured limits by table name (a shard's `source` table or its own name; `tpurec data
    stats`). A stack whose tables all have them gets fixed limits. Positional tuples (max ids, max
    unique ids[, per slice (2)[, per feature]]) are taken too, as TableLimits. Kept as a read-only
    mapping that hashes. Default None: none measured."""

    def __post_init__(self) -> None:
        for name in ("max_ids_per_partition", "max_unique_ids_per_partition", "max_ids_per_feature", "max_stack_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"KernelSettings.{name} must be >= 1 or None, got {value!r}")
        h = self.first_batch_headroom
        if h is not None and not 0 <= h <= 100:
            raise UserError(f"KernelSettings.first_batch_headroom must be in [0, 100] or None, got {h!r}")
        if self.id_limits is not None and not isinstance(self.id_limits, _TableLimitsByName):
            # converted once here, so every reader sees TableLimits (frozen: set through object);
            # none measured is None, whether given as None or as {}
            limits = _TableLimitsByName((t, _limits_of(t, v)) for t, v in self.id_limits.items())
            object.__setattr__(self, "id_limits", limits or None)

    def for_tables(self, names: Iterable[str], owner: str) -> KernelSettings:
        """These settings, refused when `id_limits` names a table `owner` (a module built over the
        tables `names`) lacks: a misspelt or another model's table bounded nothing, without a word."""
        have = set(names)
        extra = sorted(t for t in (self.id_limits or {}) if t not in have)
        if extra:
            raise UserError(
                f"KernelSettings.id_limits: table(s) {', '.join(map(repr, extra[:8]))} are not {owner}'s "
                f"(its tables: {', '.join(sorted(have)[:8])}{', ...' if len(have) > 8 else ''})"
            )
        return self

    @classmethod
    def of(cls, settings: KernelSettings | None = None, **keywords: Any) -> KernelSettings:
        """`settings`, or one built from the loose keywords the public APIs still take; not both."""
        if settings is None:
            return cls(**keywords)
        given = {k: v for k, v in keywords.items() if v != getattr(cls, k)}
        if given:
            raise UserError(f"pass either settings= or its fields as keywords, not both (got {sorted(given)})")
        return settings

    def fused(self) -> dict[str, KernelSettings]:
        """As fused params: {SETTINGS_KEY: self}, or nothing for the defaults (a sharder's fused
        params then stay TorchRec's own)."""
        return {} if self == KernelSettings() else {SETTINGS_KEY: self}

    @classmethod
    def from_fused(cls, fused_params: Mapping[str, Any] | None) -> KernelSettings:
        """The settings a sharder put in its fused params (`fused`); the defaults when none."""
        settings = (fused_params or {}).get(SETTINGS_KEY)
        return settings if isinstance(settings, KernelSettings) else cls()

    def resolved_for(self, device_type: str) -> KernelSettings:
        """A copy with the device-dependent defaults decided for tables stored on `device_type`.
        fixed_limits without id_limits stays None: the kernel follows its storage's device, which
        moves with `.to()`."""
        from tpurec.runtime import device as _device

        tpu = _device.tpu_path(device_type)
        fixed = True if self.fixed_limits is None and self.id_limits else self.fixed_limits
        copied_back = tpu and _device.tensorcore_only()  # the TensorCore kernel's updates (see above)
        return replace(
            self,
            pad_dims=tpu if self.pad_dims is None else self.pad_dims,
            widen_tables=tpu if self.widen_tables is None else self.widen_tables,
            fixed_limits=fixed,
            max_stack_bytes=TENSORCORE_MAX_STACK_BYTES
            if self.max_stack_bytes is None and copied_back
            else self.max_stack_bytes,
            first_batch_headroom=(FIRST_BATCH_HEADROOM_TENSORCORE if copied_back else FIRST_BATCH_HEADROOM)
            if self.first_batch_headroom is None
            else self.first_batch_headroom,
        )


def _limits_of(table: object, value: TableLimits | Sequence[int]) -> TableLimits:
    where = f"KernelSettings.id_limits[{table!r}]"
    if not isinstance(table, str):
        raise UserError(f"{where}: a table name is a string")
    if isinstance(value, TableLimits):
        return value
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) not in (2, 4, 5):
        raise UserError(
            f"{where} needs (max ids, max unique ids per partition[, per slice (2)[, per feature]]), got {value!r}"
        )
    for name, v in zip((f.name for f in fields(TableLimits)), value):
        _whole_limit(f"{where} {name}", v)  # named here: TableLimits would name no table
    return TableLimits.from_positions(value)
