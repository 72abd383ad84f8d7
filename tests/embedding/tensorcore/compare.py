"""How close the JAX kernels come to the CPU reference, and why not bit for bit.

The reference pools with torch's embedding_bag, whose FBGEMM kernels accumulate with fused
multiply-adds (acc = fma(gain, row, acc)); XLA's segment sum multiplies, rounds, then adds. Each
sum may so differ by about an ulp of its terms: float32 results are compared with rtol 1e-6 and an
atol of 1e-7 times the tensor's largest magnitude (a cancelling sum keeps its terms' rounding).
FP16/BF16 tables round the same float32 values, so they agree unless such an ulp decides a rounding:
then by one spacing of the table's dtype, on a rare element.
"""

from __future__ import annotations

import torch


def assert_close_f32(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * max(scale, 1.0))


def assert_close_table(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: as `assert_close_f32`; FP16/BF16: within one spacing, on at most 1% of the elements."""
    if want.dtype == torch.float32:
        assert_close_f32(got, want)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    got32, want32 = got.float(), want.float()
    mantissa = 7 if want.dtype == torch.bfloat16 else 10
    tiny = torch.finfo(want.dtype).tiny
    mag = torch.maximum(got32.abs(), want32.abs()).clamp(min=tiny)
    spacing = torch.exp2(torch.floor(torch.log2(mag)) - mantissa)
    diff = (got32 - want32).abs()
    assert bool((diff <= spacing).all()), f"{want.dtype} values differ by more than one spacing: {float(diff.max())}"
    assert int((diff > 0).sum()) <= 0.01 * diff.numel()


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
