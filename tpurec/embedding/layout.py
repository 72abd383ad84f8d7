"""MOD-partitioned table storage and table stacking.

A SparseCore table is split across P partitions (P = SparseCores per device x devices): natural row r
lives in partition r mod P at local row r div P, and partitions are stored one after another
(jax-tpu-embedding `utils.shard_emb_table`, einops `(v c s) d -> c (s v) d`). Tables of the same
dim can be stacked into one physical table: each table's vocabulary is padded to a multiple of P*8
and the tables are laid end to end in natural-id space, so inside every partition each table is one
contiguous block. Features keep their own outputs; only storage is shared.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpurec.embedding.constraints import check_dim, padded_rows


@dataclass(frozen=True)
class TableInStack:
    name: str
    num_embeddings: int  # logical rows
    offset: int  # first natural id of this table inside the stack (a multiple of P*8)
    padded_rows: int


@dataclass(frozen=True)
class StackLayout:
    """One physical table: several logical tables of the same dim, MOD-partitioned over P partitions."""

    name: str
    dim: int
    num_partitions: int
    tables: tuple[TableInStack, ...]

    @property
    def total_rows(self) -> int:
        return sum(t.padded_rows for t in self.tables)

    @property
    def rows_per_partition(self) -> int:
        return self.total_rows // self.num_partitions

    def table(self, name: str) -> TableInStack:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table {name!r} is not in stack {self.name!r}")

    # -- id mapping ---------------------------------------------------------------------------
    def physical_rows(self, natural_ids: torch.Tensor) -> torch.Tensor:
        """Row of the physical (partition-major) table holding each natural stacked id."""
        p = self.num_partitions
        return (natural_ids % p) * self.rows_per_partition + natural_ids // p

    # -- whole-table conversions (used by state_dict / load_state_dict, not on the hot path) ----
    def to_physical(self, natural: torch.Tensor) -> torch.Tensor:
        """[total_rows, ...] in natural order -> partition-major; works for 1-D row-wise state too."""
        rest = natural.shape[1:]
        v = natural.reshape(self.rows_per_partition, self.num_partitions, *rest)
        return v.transpose(0, 1).reshape(self.total_rows, *rest).contiguous()

    def to_natural(self, physical: torch.Tensor) -> torch.Tensor:
        rest = physical.shape[1:]
        v = physical.reshape(self.num_partitions, self.rows_per_partition, *rest)
        return v.transpose(0, 1).reshape(self.total_rows, *rest)

    def read_table(self, physical: torch.Tensor, name: str) -> torch.Tensor:
        """One logical table's rows (natural order, padding dropped), as a new tensor."""
        t = self.table(name)
        ids = torch.arange(t.offset, t.offset + t.num_embeddings, device=physical.device)
        return physical.index_select(0, self.physical_rows(ids))

    def write_table(self, physical: torch.Tensor, name: str, value: torch.Tensor) -> None:
        t = self.table(name)
        if value.shape[0] != t.num_embeddings or value.shape[1:] != physical.shape[1:]:
            raise ValueError(
                f"table {name!r}: expected shape {(t.num_embeddings, *physical.shape[1:])}, got {tuple(value.shape)}"
            )
        ids = torch.arange(t.offset, t.offset + t.num_embeddings, device=physical.device)
        with torch.no_grad():
            physical.index_copy_(0, self.physical_rows(ids), value.to(physical.dtype))


def build_stacks(
    tables: list[tuple[str, int, int]], num_partitions: int, stack: bool = True
) -> list[StackLayout]:
    """Group (name, num_embeddings, dim) tables into stacks: one per dim when stacking, else one each.

    Stacks come out in order of first appearance, and tables keep their order inside a stack.
    """
    groups: dict[object, list[tuple[str, int, int]]] = {}
    for name, rows, dim in tables:
        check_dim(name, dim)
        if rows <= 0:
            raise ValueError(f"table {name!r}: num_embeddings must be positive, got {rows}")
        groups.setdefault(dim if stack else name, []).append((name, rows, dim))
    layouts = []
    for key, members in groups.items():
        offset, placed = 0, []
        for name, rows, _ in members:
            pad = padded_rows(rows, num_partitions)
            placed.append(TableInStack(name, rows, offset, pad))
            offset += pad
        stack_name = f"stack_d{key}" if stack else str(key)
        layouts.append(StackLayout(stack_name, members[0][2], num_partitions, tables=tuple(placed)))
    return layouts
