"""Which table row each cache slot holds, and where each row is cached (if it is)."""

from __future__ import annotations

import numpy as np

EMPTY = -1  # a slot holding no row; a row in no slot


class SlotMap:
    """`slot_of[row]` and `row_of[slot]`, kept inverse to each other."""

    def __init__(self, rows: int, slots: int) -> None:
        # int32 per table row: 4 bytes a row against the row's own dim x 4 (and its optimizer state)
        self.slot_of = np.full(rows, EMPTY, np.int32)
        self.row_of = np.full(slots, EMPTY, np.int64)

    def occupied(self) -> np.ndarray:
        """The slots holding a row (increasing)."""
        return np.flatnonzero(self.row_of != EMPTY)

    def free(self) -> np.ndarray:
        """The slots holding none (increasing)."""
        return np.flatnonzero(self.row_of == EMPTY)

    def assign(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Rows `rows` (not cached) now live in `slots` (free)."""
        self.slot_of[rows] = slots
        self.row_of[slots] = rows

    def release(self, slots: np.ndarray) -> None:
        """`slots` hold no row any more (their rows are cached nowhere)."""
        self.slot_of[self.row_of[slots]] = EMPTY
        self.row_of[slots] = EMPTY
