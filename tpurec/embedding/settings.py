"""KernelSettings: the SparseCore kernel's buffer and layout settings, as one frozen object.

The modules, the sharders' fused params and the DMP build one from their keywords and hand it to
SparseCoreKernel whole. Settings left as None are decided by the storage device, in one place:
`resolved_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from tpurec.errors import UserError


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
    on when table_limits are given, else on where the tables are stored on a TPU (TorchTPU compiles
    the limits into the program, so limits sized to each batch would recompile every step);
    elsewhere limits left as None follow each batch."""

    pad_dims: bool | None = None
    """Store rows padded to 8 floats, as the SparseCore needs (layout.py). Default None: on a TPU
    device only; tests force it on CPU to exercise the padded path."""

    widen_tables: bool | None = None
    """Store FP16/BF16 tables as float32, with one warning naming them. Default None: on a TPU device
    only, where TorchTPU's SparseCore ops take float32 tables (`tpurec.embedding.dtypes`). Otherwise
    each table is stored in its dtype and updated in float32, rounded once per step."""

    table_limits: Mapping[str, tuple[int, ...]] | None = None
    """Measured limits by table name (a shard's `source` table or its own name; `tpurec data
    stats`): (max ids, max unique ids) per partition of the table alone, optionally followed by the
    same per SparseCore slice and the most ids of one feature. A stack whose tables all have them
    gets fixed limits. Default None: none measured."""

    def __post_init__(self) -> None:
        for name in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"KernelSettings.{name} must be >= 1 or None, got {value!r}")
        for table, limits in (self.table_limits or {}).items():
            if len(limits) < 2:
                raise UserError(
                    f"KernelSettings.table_limits[{table!r}] needs (max ids, max unique ids), got {limits!r}"
                )

    @classmethod
    def of(cls, settings: KernelSettings | None = None, **keywords: Any) -> KernelSettings:
        """`settings`, or one built from the loose keywords the public APIs still take; not both."""
        if settings is None:
            return cls(**keywords)
        given = {k: v for k, v in keywords.items() if v != getattr(cls, k)}
        if given:
            raise UserError(f"pass either settings= or its fields as keywords, not both (got {sorted(given)})")
        return settings

    def resolved_for(self, device_type: str) -> KernelSettings:
        """A copy with the device-dependent defaults decided for tables stored on `device_type`.
        fixed_limits without table_limits stays None: the kernel follows its storage's device, which
        moves with `.to()`."""
        from tpurec.runtime import device as _device

        tpu = _device.tpu_path(device_type)
        fixed = True if self.fixed_limits is None and self.table_limits else self.fixed_limits
        return replace(
            self,
            pad_dims=tpu if self.pad_dims is None else self.pad_dims,
            widen_tables=tpu if self.widen_tables is None else self.widen_tables,
            fixed_limits=fixed,
        )
