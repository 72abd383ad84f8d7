"""A KeyedJaggedTensor's ids of host-tier tables replaced by their cache slots.

Only the values change: keys, lengths, weights and batch stay, so the kernel pools the same bags in
the same order. Why that keeps the numbers of the all-resident table (docs/host_tier.md): the kernel's
direct CPU step sums a bag in its ids' order and each row's gradient in its entries' bag order,
whatever the row's number, and updates each row on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.host_tier.table_tier import TableTier
from tpurec.embedding.kernel_table import KernelTable, out_of_range


def remap_kjt(
    features: KeyedJaggedTensor,
    key_features: Sequence[str | None],
    tables: Mapping[str, KernelTable],
    tiers: Mapping[str, TableTier],
    map_ids: Callable[[str, np.ndarray], np.ndarray],
) -> KeyedJaggedTensor:
    """`features` (on the host, checked) with each host-tier table's ids mapped to its cache slots.
    key_features: the kernel feature each key feeds (None: none); tables: each kernel feature's table
    as the user sized it (ids are checked against its rows); tiers: the host-tier tables by name;
    map_ids(table, ids): their slots, the rows missing loaded (`TableTier.map_ids`)."""
    offsets = features.offset_per_key()
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for j, feature in enumerate(key_features):
        table = tables.get(feature) if feature is not None else None
        if feature is not None and table is not None and table.name in tiers:
            spans.setdefault(table.name, []).append((offsets[j], offsets[j + 1], feature))
    if not spans:
        return features
    source = features.values().numpy()
    values = source.copy()
    for name, parts in spans.items():
        rows = tiers[name].params.rows
        for lo, hi, feature in parts:
            piece = source[lo:hi]
            if piece.size and (int(piece.min()) < 0 or int(piece.max()) >= rows):
                raise out_of_range(tables[feature], feature, torch.from_numpy(piece))
        ids = np.concatenate([source[lo:hi] for lo, hi, _ in parts]).astype(np.int64, copy=False)
        slots = map_ids(name, ids)
        at = 0
        for lo, hi, _ in parts:
            values[lo:hi] = slots[at : at + hi - lo]
            at += hi - lo
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=torch.from_numpy(values),
        lengths=features.lengths(),
        weights=features.weights_or_none(),
        stride=features.stride(),
        length_per_key=features.length_per_key(),
        offset_per_key=offsets,
    )
