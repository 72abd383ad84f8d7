"""Vectorised parsing of Criteo text columns (hex categoricals, numeric dense, 0/1 labels).

Every function takes a pyarrow string array and returns (numpy values, numpy bad-row mask), so the
converter can either name the first bad line or drop bad lines, without a per-row Python loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

# Byte -> nibble value; 255 marks a byte that is not a hex digit.
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_MAX_HEX_DIGITS = 16
_NUMBER = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32/int64[n+1], data uint8[]) of a pyarrow (large_)string array, zero-copy."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        arr = arr.fill_null("")
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.string())
    bufs = arr.buffers()
    odt = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=odt)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    return offsets, data


def parse_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hex strings -> (uint64 values, empty mask, bad mask). Empty strings give value 0."""
    offsets, data = _string_buffers(arr)
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    n = len(lengths)
    values = np.zeros(n, dtype=np.uint64)
    bad = lengths > _MAX_HEX_DIGITS
    if len(data) == 0:
        data = np.zeros(1, np.uint8)
    width = int(lengths.max(initial=0))
    full = lengths == width
    if width in (8, 16) and np.all(full | (lengths == 0)):
        # Criteo's case: every value has 8 digits or is empty, so the string bytes are one
        # [non-empty rows, 8] block: no gather; pairs of nibbles make the big-endian bytes.
        block = data[offsets[0] : offsets[-1]].reshape(-1, width)
        nib = _HEX[block]
        bad[full] = (nib == 255).any(axis=1)
        packed = np.ascontiguousarray((nib[:, 0::2] << 4) | (nib[:, 1::2] & 15))
        values[full] = packed.view(">u4" if width == 8 else ">u8").reshape(-1)
        return values, lengths == 0, bad
    maxlen = int(min(width, _MAX_HEX_DIGITS))
    for j in range(maxlen):  # loop over digit positions (<= 16), vectorised over rows
        has = lengths > j
        nib = _HEX[data[np.minimum(starts + j, len(data) - 1)]]
        bad |= has & (nib == 255)
        values = np.where(has, (values << np.uint64(4)) | nib.astype(np.uint64), values)
    return values, lengths == 0, bad


_MAX_DECIMAL_DIGITS = 19  # below 2^63: every such id is an int64


def parse_decimal(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decimal digit strings (ids) -> (uint64 values, empty mask, bad mask). Empty strings give value 0;
    a sign, a point or more than 19 digits is bad."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        arr = arr.fill_null("")
    empty = pc.equal(arr, "").to_numpy(zero_copy_only=False)
    ok = pc.match_substring_regex(arr, f"^[0-9]{{1,{_MAX_DECIMAL_DIGITS}}}$").to_numpy(zero_copy_only=False)
    safe = pc.if_else(pa.array(ok), arr, pa.scalar("0"))
    values = safe.cast(pa.uint64()).to_numpy(zero_copy_only=False)
    return values, empty, ~(ok | empty)


def parse_numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal strings (ints or floats, maybe negative) -> (float64 values, bad mask); empty -> 0.
    Non-finite values ("nan", "inf", "1e400") are bad too: a NaN feature trains to a NaN loss."""
    values, bad = _parse_numbers(arr)
    nonfinite = ~np.isfinite(values)
    if nonfinite.any():
        values = np.where(nonfinite, 0.0, values)
        bad = bad | nonfinite
    return values, bad


def _parse_numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type):  # already parsed by the CSV reader
        if arr.null_count:
            arr = arr.fill_null(0)
        return arr.to_numpy(zero_copy_only=False).astype(np.float64, copy=False), np.zeros(len(arr), bool)
    if arr.null_count:
        arr = arr.fill_null("")
    filled = pc.if_else(pc.equal(arr, ""), pa.scalar("0"), arr)
    try:
        return filled.cast(pa.float64()).to_numpy(zero_copy_only=False), np.zeros(len(arr), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        # Slow path, only when something is wrong: find which rows are not numbers.
        ok = pc.match_substring_regex(filled, _NUMBER).to_numpy(zero_copy_only=False)
        safe = pc.if_else(pa.array(ok), filled, pa.scalar("0"))
        return safe.cast(pa.float64()).to_numpy(zero_copy_only=False), ~ok


def parse_labels(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """'0'/'1' -> (int8 values, bad mask). Anything else (including empty) is bad."""
    offsets, data = _string_buffers(arr)
    lengths = offsets[1:] - offsets[:-1]
    if len(data) == 0:
        data = np.zeros(1, np.uint8)
    first = data[np.minimum(offsets[:-1], len(data) - 1)]
    ok = (lengths == 1) & ((first == ord("0")) | (first == ord("1")))
    return np.where(ok, first - ord("0"), 0).astype(np.int8), ~ok


def hash_ids(raw: np.ndarray, empty: np.ndarray, num_embeddings: int) -> np.ndarray:
    """The default categorical hashing (CAT_HASH): empty -> 0, else 1 + raw mod (num_embeddings - 1).

    Id 0 is reserved for "empty", so a missing value never shares a row with a real one.
    """
    ids = (raw % np.uint64(num_embeddings - 1)).astype(np.int64) + 1
    ids[empty] = 0
    return ids


def dense_log1p(x: np.ndarray) -> np.ndarray:
    """The default dense transform (DENSE_LOG1P): log(max(x, 0) + 1) as float32."""
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)
