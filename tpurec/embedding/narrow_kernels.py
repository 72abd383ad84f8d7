"""The host's one-pass encodings of input_copy.py's narrow forms (numba, loaded on first use).

Each checks and encodes in one pass over the array (torch's masks, min/max and casts took ~5 passes:
22 ms a step for MLPerf's sample ids and gains on this CPU) and says False, `out` then of no use,
when a value does not fit the form exactly.
"""

from __future__ import annotations

import numba
import numpy as np

from tpurec.embedding.constraints import PADDING_ID

_PAD = np.int32(PADDING_ID)


@numba.njit(cache=True, nogil=True)
def to_i16(src: np.ndarray, out: np.ndarray) -> bool:
    """int32 values in [0, 65535) as value - 32768, the padding id as 32767 (input_copy.I16)."""
    bad = 0
    for i in range(src.size):  # branch-free (vectorised): flags counted, decided at the end
        v = src[i]
        pad = v == _PAD
        bad += ~pad & (np.uint32(v) >= np.uint32(65535))  # unsigned: a negative value is huge
        out[i] = np.int16(32767) if pad else np.int16(v - 32768)
    return bad == 0


@numba.njit(cache=True, nogil=True)
def to_bf16_bits(bits: np.ndarray, out: np.ndarray) -> bool:
    """float32 bit patterns (int32) whose low 16 bits are zero, i.e. exact in bfloat16 (NaN padding
    too): their high 16 bits, bfloat16's own (input_copy.BF16)."""
    for i in range(bits.size):
        b = bits[i]
        if b & 0xFFFF:
            return False
        out[i] = b >> 16
    return True
