"""argparse types that refuse values outside their domain (argparse then exits 2 naming the flag):
a negative headroom, a zero batch or a NaN learning rate is an error, never clamped or wrapped."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N", int, float)


def _number(text: str, kind: type[_N]) -> _N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _domain(kind: type[_N], ok: Callable[[_N], bool], what: str) -> Callable[[str], _N]:
    """An argparse type: parse `kind`, then refuse values for which `ok(value)` is false."""

    def parse(text: str) -> _N:
        value = _number(text, kind)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value

    return parse


positive_int = _domain(int, lambda v: v > 0, "> 0")
nonnegative_int = _domain(int, lambda v: v >= 0, ">= 0")
positive_float = _domain(float, lambda v: v > 0, "> 0")
nonnegative_float = _domain(float, lambda v: v >= 0, ">= 0")
fraction_below_one = _domain(float, lambda v: 0 <= v < 1, "in [0, 1)")  # a share: HBM kept free, data held out
fraction_above_zero = _domain(float, lambda v: 0 < v <= 1, "in (0, 1]")  # e.g. SparseCore share of HBM bw
# a seed: torch.manual_seed takes 64 bits and numpy's generators any int; 2^64 was torch's
# "Overflow when unpacking long long" traceback, so seeds stay in what every consumer takes
seed_int = _domain(int, lambda v: 0 <= v < 2**63, "in [0, 2^63)")

# steps between two events (--zch-eviction-interval): a whole number TorchRec's modules hold as a C int
step_interval = _domain(int, lambda v: 1 <= v <= 2**31 - 1, "a whole number of steps in [1, 2^31-1]")

PARQUET_CODECS = ("none", "snappy", "gzip", "brotli", "zstd", "lz4")  # pyarrow's Parquet writer's


def parquet_codec(text: str) -> str:
    """A Parquet codec name (any case): `--compression bogus` was pyarrow's traceback after the output
    directory had been made, and left it empty."""
    if text.lower() not in PARQUET_CODECS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Parquet codec (choose from {', '.join(PARQUET_CODECS)})")
    return text.lower()


def int_list(text: str) -> tuple[int, ...]:
    """Layer sizes as "512,256,128" (or "512 256 128"): whole numbers > 0."""
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of sizes like 512,256,128")
    return tuple(positive_int(p) for p in parts)
