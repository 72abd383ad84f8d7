"""Table storage in natural row order, and table stacking.

A SparseCore table is split across P partitions (P = SparseCores per device x devices) and stored
partition-major: the SparseCore op reads partition p's local row l at physical row p*C + l (C rows per
partition), and it puts id v in partition v mod P at local row v div P ("MOD sharding";
jax-tpu-embedding `utils.shard_emb_table`).

tpurec keeps the physical table in NATURAL row order and feeds the SparseCore renamed ids instead:
natural stacked row s becomes v = (s mod C) * P + s div C, so MOD sends v to partition s div C, local
row s mod C, which is physical row s. Renaming costs a few integer ops per id on the host; in return
every table (and its optimizer state) is a contiguous slice of the physical tensor, so `state_dict()`
hands out views of the live storage: TorchRec's tools and torch.distributed.checkpoint write into
them in place, and no natural-order copy is ever held (docs/dmp.md, "Storage and state_dict").
The price: partition p holds natural rows [p*C, (p+1)*C), so the SparseCores balance when ids are
spread over the table (hashed ids, as in Criteo) and not when low ids are the hot ones
(frequency-sorted vocabularies); docs/dmp.md gives measured figures.

Tables of the same dim and stored dtype can be stacked into one physical table: each table's
vocabulary is padded to a multiple of P*8 and the tables are laid end to end. Features keep their
own outputs; only storage is shared. A stack of FP16/BF16 tables is stored in that dtype
(`tpurec.embedding.dtypes` says where it must be widened).

Any embedding dim works: the SparseCore wants rows a multiple of 8 floats wide, so on a TPU a stack
of dim d is stored `storage_dim = round_up(d, 8)` wide (`pad_to=8`); the extra columns stay zero
(their gradients are zero) and every view, output and state_dict entry is cut back to d. Such a
view is not contiguous, so a ShardedTensor gets a copy of it (refreshed and written back like
before natural-order storage); the CPU reference needs no padding (`pad_to=1`), so there every
table is a contiguous view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpurec.embedding.constraints import DIM_ALIGN, padded_rows, round_up
from tpurec.errors import UserError


@dataclass(frozen=True)
class TableInStack:
    name: str
    num_embeddings: int  # logical rows
    offset: int  # first row of this table inside the stack (a multiple of P*8)
    padded_rows: int


@dataclass(frozen=True)
class StackLayout:
    """One physical table: several logical tables of the same dim, MOD-partitioned over P partitions."""

    name: str
    dim: int  # the tables' embedding dim
    num_partitions: int
    tables: tuple[TableInStack, ...]
    pad_to: int = 1  # storage width multiple: DIM_ALIGN (8) for the SparseCore, 1 for the CPU reference
    dtype: torch.dtype = torch.float32  # the stored element type of the physical table

    @property
    def storage_dim(self) -> int:
        """Columns of the physical table: dim rounded up to `pad_to`."""
        return round_up(self.dim, self.pad_to)

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

    # -- id renaming -------------------------------------------------------------------------
    def sparsecore_ids(self, stacked_rows: torch.Tensor) -> torch.Tensor:
        """The id to give the SparseCore for each natural stacked row, so that MOD partitioning lands
        it on the same physical row: v = (s mod C) * P + s div C (int64 in, int64 out)."""
        c = self.rows_per_partition
        return (stacked_rows % c) * self.num_partitions + stacked_rows // c

    # -- one table of the stack --------------------------------------------------------------------
    def read_table(self, physical: torch.Tensor, name: str) -> torch.Tensor:
        """One logical table's rows (natural order, padding dropped): a VIEW of `physical`, so writes
        into it (in-place checkpoint loads) land in the live table."""
        t = self.table(name)
        rows = physical[t.offset : t.offset + t.num_embeddings]
        return rows[:, : self.dim] if rows.dim() == 2 and rows.shape[1] != self.dim else rows

    def write_table(self, physical: torch.Tensor, name: str, value: torch.Tensor) -> None:
        target = self.read_table(physical, name)
        if value.shape != target.shape:
            raise UserError(f"table {name!r}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
        if target.data_ptr() != value.data_ptr():  # a state_dict view written in place is already there
            with torch.no_grad():
                target.copy_(value)


def build_stacks(
    tables: list[tuple],
    num_partitions: int,
    stack: bool = True,
    pad_to: int = DIM_ALIGN,
    expected_ids: dict[str, float] | None = None,
    max_bytes: int | None = None,
) -> list[StackLayout]:
    """Group (name, num_embeddings, dim[, stored dtype]) tables into stacks: one per (dim, dtype) when
    stacking, else one each. A float32 stack of dim d is "stack_d<d>", others "stack_d<d>_<dtype>".
    `max_bytes`: a (dim, dtype) group whose stored rows would take more is cut into consecutive
    stacks of at most that many bytes each (a table larger alone gets a stack of its own), named
    "..._p1", "..._p2" after the first.

    Stacks come out in order of first appearance, and tables keep their order inside a stack, unless
    `expected_ids` (ids per sample by table name) covers every table of a stack: then they are placed
    so that the partitions expect the same ids (`stack_order.balanced_order`).
    """
    groups: dict[object, list[tuple[str, int, int, torch.dtype]]] = {}
    for name, rows, dim, *given in tables:
        if dim <= 0:
            raise UserError(f"table {name!r}: embedding_dim must be positive, got {dim}")
        if rows < 0:
            raise UserError(f"table {name!r}: num_embeddings must be >= 0, got {rows}")
        dtype = given[0] if given else torch.float32
        groups.setdefault((dim, dtype) if stack else name, []).append((name, rows, dim, dtype))
    layouts = []
    for key, members in groups.items():
        if expected_ids and len(members) > 1 and all(m[0] in expected_ids for m in members):
            from tpurec.embedding.stack_order import balanced_order

            pads = [padded_rows(max(m[1], 1), num_partitions) for m in members]
            order = balanced_order([m[1] for m in members], pads, [float(expected_ids[m[0]]) for m in members],
                                   num_partitions)  # fmt: skip
            members = [members[i] for i in order]
        dim, dtype = members[0][2], members[0][3]
        if not stack:
            stack_name = str(key)
        else:
            suffix = "" if dtype == torch.float32 else "_" + str(dtype).removeprefix("torch.")
            stack_name = f"stack_d{dim}{suffix}"
        row_bytes = round_up(dim, pad_to) * dtype.itemsize
        for part, chunk in enumerate(_cut(members, num_partitions, row_bytes, max_bytes)):
            name = stack_name if part == 0 else f"{stack_name}_p{part}"
            layouts.append(StackLayout(name, dim, num_partitions, tables=chunk, pad_to=pad_to, dtype=dtype))
    return layouts


def _cut(
    members: list[tuple[str, int, int, torch.dtype]], num_partitions: int, row_bytes: int, max_bytes: int | None
) -> list[tuple[TableInStack, ...]]:
    """The members placed in stacks, in order: one stack, or consecutive ones of at most `max_bytes`."""
    stacks: list[tuple[TableInStack, ...]] = []
    offset, placed = 0, list[TableInStack]()
    for name, rows, _, _ in members:
        # An empty table (a row-wise shard past the end of a small table: TorchRec gives rank 3 of
        # 4 no rows of a 9-row table) still gets one segment of storage, so that a stack holding
        # only it has partitions to divide by; no id can reach it (ids must be < 0 rows).
        pad = padded_rows(max(rows, 1), num_partitions)
        if placed and max_bytes is not None and (offset + pad) * row_bytes > max_bytes:
            stacks.append(tuple(placed))
            offset, placed = 0, list[TableInStack]()
        placed.append(TableInStack(name, rows, offset, pad))
        offset += pad
    return [*stacks, tuple(placed)]
