"""KernelTable: one table as a SparseCoreKernel sees it, shared by the kernel's storage half
(kernel.py) and its input half (kernel_input.py), so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.modules.embedding_configs import PoolingType

from tpurec.errors import UserError

# The poolings the kernel computes: TorchRec's own enum, so a config's pooling reaches the kernel as is.
POOLINGS = (PoolingType.SUM, PoolingType.MEAN)


@dataclass(frozen=True)
class KernelTable:
    """A table as this device sees it (under sharding: the local shard's rows and columns)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    # TorchRec's PoolingType (SUM or MEAN); "sum" / "mean" are taken too, as the enum (`__post_init__`)
    pooling: PoolingType = PoolingType.SUM
    init_rows: int | None = None  # rows of the whole (unsharded) table, for EBC's init bound
    # The config's weight_init_min/max (TorchRec's get_weight_init_min/max); None: +-sqrt(1/rows).
    init_min: float | None = None
    init_max: float | None = None
    dtype: torch.dtype = torch.float32  # the config's dtype (stored as such unless widened)
    source: str | None = None  # the whole table's name when this is a shard (for messages)
    # Under sharding: the user's feature name of each of `feature_names` (the kernel's own are slots,
    # "1:item_id"), and the shard's first row in the whole table (a row-wise shard's ids are local).
    source_features: tuple[str, ...] = ()
    row_offset: int = 0
    # Ids per sample this table expects over its features (pooling factors): when every table of a
    # stack has one, the stack places its tables so the SparseCore partitions share them (stack_order).
    expected_ids: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pooling, str):  # the strings callers pass, turned into the enum once, here
            pooling = PoolingType.__members__.get(self.pooling.upper())
            if pooling is None:
                raise UserError(f"table {self.name!r}: pooling {self.pooling!r} is not supported (sum or mean)")
            object.__setattr__(self, "pooling", pooling)


def out_of_range(table: KernelTable, feature: str, ids: torch.Tensor) -> IdOutOfRange:
    """The error for `ids` of `feature` (one of `table.feature_names`) some of which lie outside `table`:
    named as the user named them (the whole table, its rows and ids; under sharding the kernel's table
    is a shard and its features are slots)."""
    user_feature = dict(zip(table.feature_names, table.source_features)).get(feature, feature)
    rows = table.init_rows if table.source is not None and table.init_rows is not None else table.num_embeddings
    low, high = int(ids.min()) + table.row_offset, int(ids.max()) + table.row_offset
    return IdOutOfRange(
        f"feature {user_feature!r} (table {table.source or table.name!r}): ids must be in [0, {rows}), "
        f"got min {low}, max {high}"
    )


class IdOutOfRange(UserError, IndexError):
    """A batch holds an id outside its table's rows. An IndexError too, as it was before it was a UserError."""


def index_tables(tables: list[KernelTable]) -> tuple[dict[str, KernelTable], dict[str, KernelTable]]:
    """({name: table}, {feature: its table}), refusing repeated names, features fed to two tables
    and poolings other than sum and mean."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise UserError(f"duplicate table names: {names}")
    feature_table: dict[str, KernelTable] = {}
    for t in tables:
        if t.pooling not in POOLINGS:
            raise UserError(f"table {t.name!r}: pooling {t.pooling.name.lower()!r} is not supported (sum or mean)")
        for f in t.feature_names:
            if f in feature_table:
                raise UserError(f"feature {f!r} is used by tables {feature_table[f].name!r} and {t.name!r}")
            feature_table[f] = t
    return {t.name: t for t in tables}, feature_table
