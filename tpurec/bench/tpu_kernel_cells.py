"""The cells `tpurec bench tpu-kernels` measures: table rows x width x dtype, batch x pooling, id law."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    rows: int
    width: int
    batch: int
    pooling: int
    dist: str = "uniform"
    dtype: str = "float32"

    @property
    def ids(self) -> int:
        return self.batch * self.pooling

    def __str__(self) -> str:
        return f"{self.rows}x{self.width} {self.dtype} B{self.batch} H{self.pooling} {self.dist}"


CHIP_CELLS = [
    Cell(1_000_000, 128, 16384, 8),
    Cell(1_000_000, 256, 16384, 8),
    Cell(1_000_000, 64, 16384, 8),
    Cell(1_000_000, 16, 16384, 8),
    Cell(1_000_000, 128, 16384, 1),
    Cell(1_000_000, 128, 4096, 32),
    Cell(1_000_000, 128, 16384, 8, "zipf"),
    Cell(1_000_000, 128, 16384, 8, dtype="bfloat16"),
    Cell(4_000_000, 128, 16384, 8),
]
CPU_CELLS = [Cell(2000, 128, 32, 4, "zipf")]
