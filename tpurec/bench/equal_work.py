"""Equal work, checked once per comparison before anything is timed.

Two sides that start from the same tables and take one step on the same ids with the same upstream
gradient must return the same pooled outputs and leave the same tables (every row of every table,
so an update that skips rows, touches extra ones or applies another optimizer shows). The upstream
gradient holds small positive integers, so every row's gradient is an exact sum in float32 whatever
the order of summation: the tables may differ only by the rounding of the update arithmetic, and
the tolerance (float32's, as torch.testing's defaults for float32 but with a 1e-5 relative
margin for summation order in the outputs) does not hide a different update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

RTOL, ATOL = 1e-5, 1e-5


class UnequalWork(AssertionError):
    """The two sides did not compute the same step: the comparison must not be reported."""


def upstream_gradient(batch: int, width: int, seed: int = 0) -> torch.Tensor:
    """[batch, width] float32 integers in 1..4: exact per-row gradient sums on every side."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 5, (batch, width), generator=g).float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check(ours: Any, theirs: Any, kjt: KeyedJaggedTensor, upstream: torch.Tensor) -> dict:
    """One step of each side on `kjt`; UnequalWork naming the first difference beyond tolerance,
    else the largest absolute differences seen (outputs, tables)."""
    import torch

    out_a, out_b = ours.step(kjt, upstream), theirs.step(kjt, upstream)
    if out_a.shape != out_b.shape:
        raise UnequalWork(f"pooled outputs differ in shape: {ours.name} {tuple(out_a.shape)}, "
                          f"{theirs.name} {tuple(out_b.shape)}")  # fmt: skip
    if not torch.allclose(out_a, out_b, rtol=RTOL, atol=ATOL):
        raise UnequalWork(f"pooled outputs differ: max |{ours.name} - {theirs.name}| = {_max_diff(out_a, out_b):.3g}")
    tables_a, tables_b = ours.tables(), theirs.tables()
    if len(tables_a) != len(tables_b):
        raise UnequalWork(f"{ours.name} holds {len(tables_a)} tables, {theirs.name} {len(tables_b)}")
    worst = 0.0
    for k, (a, b) in enumerate(zip(tables_a, tables_b)):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            diff = _max_diff(a, b) if a.shape == b.shape else float("inf")
            raise UnequalWork(f"table {k} differs after one step: max |{ours.name} - {theirs.name}| = {diff:.3g}")
        worst = max(worst, _max_diff(a, b))
    return {"max_abs_diff_outputs": _max_diff(out_a, out_b), "max_abs_diff_tables": worst, "rtol": RTOL, "atol": ATOL}
