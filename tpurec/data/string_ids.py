"""The id of a string: ``splitmix64(fnv1a64(utf-8 bytes))``, vectorised over an Arrow string column.

Stable across processes, machines and versions (unlike Python's ``hash()``), and short to write in any
language (``reference`` below is the definition). FNV-1a 64 hashes the bytes; splitmix64 (the
finaliser of tpurec/data/synth.py) mixes every input bit into the low bits, which ``mod ROWS`` keeps.
The loop runs over byte positions, not strings: strings sorted longest first, so position ``p``
updates the prefix of strings longer than ``p`` (about 30 ms per million short strings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpurec.data.synth import _splitmix64

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_M64 = (1 << 64) - 1


def reference(s: str | bytes) -> int:
    """The definition, one string at a time (what ``string_hash`` computes for a column)."""
    h = FNV_OFFSET
    for b in s.encode() if isinstance(s, str) else s:
        h = ((h ^ b) * FNV_PRIME) & _M64
    h = (h + 0x9E3779B97F4A7C15) & _M64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


def string_hash(vals: Any) -> np.ndarray:
    """uint64 per string of an Arrow string/binary array without nulls; each distinct string hashed once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not len(vals):
        return np.empty(0, np.uint64)
    enc = pc.dictionary_encode(vals)
    h = _fnv_splitmix(enc.dictionary.cast(pa.large_binary()))
    return h[np.asarray(enc.indices.to_numpy(zero_copy_only=False), np.int64)]


def _fnv_splitmix(arr: Any) -> np.ndarray:
    n = len(arr)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, np.int64, count=n + 1, offset=arr.offset * 8)
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")
    starts, neg_sorted = offsets[:-1][order], -lengths[order]  # ascending: longest first
    h = np.full(n, FNV_OFFSET, np.uint64)
    prime = np.uint64(FNV_PRIME)
    for p in range(int(-neg_sorted[0]) if n else 0):
        k = int(np.searchsorted(neg_sorted, -p, side="left"))  # strings longer than p
        head = h[:k]  # a view: updated in place
        head ^= data[starts[:k] + p].astype(np.uint64)
        head *= prime  # wraps mod 2^64
    with np.errstate(over="ignore"):
        mixed = _splitmix64(h)
    out = np.empty(n, np.uint64)
    out[order] = mixed
    return out
