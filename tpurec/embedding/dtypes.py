"""Table dtypes: what a table is stored in on each device, and what it costs per element.

A table is stored in its config's dtype (TorchRec `EmbeddingBagConfig.data_type`: FP32, FP16, BF16)
where the kernel can: on CPU the reference kernels do, computing the update in float32 and rounding
the new row once to the table's dtype (round to nearest even), as FBGEMM's CPU TBE does for FP16
weights (its `stochastic_rounding` flag is unused on CPU). Optimizer state stays float32 and pooled
outputs are float32, as with TorchRec's fused kernel.

On a TPU, FP16/BF16 tables are WIDENED to float32: TorchTPU 0.2.0's SparseCore ops are built for
float32 tables (the lookup's output and the optimizer update functions are typed f32 in its op
builders; jax-tpu-embedding, which emits the same SparseCore call, refuses any other table dtype;
torchrec's own SparseCore module stores float32). Facts and where they were read: docs/tpu.md. The
kernel says so once in a warning, and the planner counts 4 bytes per element there.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from tpurec.errors import UserError
from tpurec.runtime.device import tpu_path

if TYPE_CHECKING:
    from torchrec.types import DataType

# Config dtypes the kernel trains; quantized types (INT8/INT4/INT2, FP8) are TorchRec inference formats.
TRAINABLE = (torch.float32, torch.float16, torch.bfloat16)
WIDEN_REASON = "TorchTPU 0.2.0's SparseCore ops are built for float32 tables (docs/tpu.md)"
_WARNED: set[str] = set()


def table_dtype(data_type: DataType | torch.dtype, table: str = "?") -> torch.dtype:
    """The torch dtype of a TorchRec DataType (or a torch dtype); refuses what the kernel cannot train."""
    dtype: torch.dtype | None = data_type if isinstance(data_type, torch.dtype) else None
    if not isinstance(data_type, torch.dtype):
        from torchrec.modules.embedding_configs import data_type_to_dtype

        try:
            dtype = data_type_to_dtype(data_type)
        except Exception:
            dtype = None
    if dtype not in TRAINABLE:
        name = getattr(data_type, "name", data_type)
        raise UserError(
            f"table {table!r}: data_type {name} is not trainable by the SparseCore kernel "
            "(FP32, FP16 or BF16; quantized tables are TorchRec inference formats)"
        )
    assert dtype is not None  # TRAINABLE holds dtypes only
    return dtype


def widens(device_type: str, widen: bool | None = None) -> bool:
    """Whether FP16/BF16 tables are stored as float32 on this device (default: on a TPU)."""
    return tpu_path(device_type) if widen is None else bool(widen)


def stored_dtype(dtype: torch.dtype, device_type: str = "cpu", widen: bool | None = None) -> torch.dtype:
    """The dtype a table of config dtype `dtype` is stored in."""
    return torch.float32 if widens(device_type, widen) else dtype


def element_bytes(dtype: torch.dtype, device_type: str = "cpu", widen: bool | None = None) -> int:
    """Bytes per stored table element (what the planner counts)."""
    return stored_dtype(dtype, device_type, widen).itemsize


NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # TorchRec DataType, lower case


def short_name(dtype: torch.dtype) -> str:
    return {d: n for n, d in NAMES.items()}.get(dtype, str(dtype))


def from_name(name: str) -> torch.dtype:
    if name.lower() not in NAMES:
        raise UserError(f"data_type {name!r}: one of {sorted(NAMES)}")
    return NAMES[name.lower()]


def warn_widened(tables: dict[str, torch.dtype]) -> None:
    """One warning per process for tables (name -> config dtype) stored as float32 instead."""
    new = {n: d for n, d in tables.items() if d != torch.float32 and n not in _WARNED}
    if not new:
        return
    _WARNED.update(new)
    listed = ", ".join(f"{n} ({short_name(d)})" for n, d in new.items())
    warnings.warn(
        f"tpurec: table(s) {listed} are stored and trained as float32 on the TPU: {WIDEN_REASON}; "
        "state_dict() gives them as float32 and the planner counts 4 bytes per element",
        stacklevel=3,
    )
