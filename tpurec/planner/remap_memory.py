"""The host memory of a model's managed-collision remaps, per table and per rank, for the plan report.

tpurec runs every remap on the host (tpurec/sharding/mc_sharder.py), so its buffers cost host RAM,
not HBM: the ids kept (`_mch_sorted_raw_ids`), the rows they map to (`_mch_remapped_ids_mapping`) and
the eviction policy's metadata (`_mch_last_access_iter`, `_mch_counts`, ...), each one entry per
slot, plus a few fixed buffers (`_output_segments_tensor`, ...). TorchRec's multi-probe remap
(`HashZchManagedCollisionModule`) keeps its ids in a frozen parameter (`_hash_zch_identities`, one int64
per slot), which its own `buffers()` yields beside its eviction metadata (int32 per slot). A row-wise
shard of the table holds the slots of its rows (the hash remap's slots per training rank). The
figures are read off the model's own module tensors (a meta-device model has their shapes), so they
follow whatever TorchRec's module allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class RemapBuffers:
    """One table's remap: bytes per slot (buffers with a row per slot) and fixed bytes (the rest,
    held by every shard)."""

    slots: int
    bytes_per_slot: int
    fixed_bytes: int

    def shard_bytes(self, rows: int) -> int:
        return rows * self.bytes_per_slot + self.fixed_bytes


def remap_buffers(module: nn.Module) -> dict[str, RemapBuffers]:
    """{table: RemapBuffers} of every managed-collision module in `module` (keyed by table name, as
    TorchRec's ManagedCollisionCollection keys them); {} for a model without any."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    out: dict[str, RemapBuffers] = {}
    for m in module.modules():
        if not isinstance(m, BaseManagedCollisionEmbeddingCollection):
            continue
        for table, mc in m._managed_collision_collection._managed_collision_modules.items():
            slots = int(getattr(mc, "_zch_size", 0))  # both modules' slots, the whole table's
            if slots < 1:
                continue
            per_slot = fixed = 0
            for b in mc.buffers():
                size = b.numel() * b.element_size()
                if b.dim() >= 1 and b.shape[0] == slots:
                    per_slot += size // slots
                else:
                    fixed += size
            out[str(table)] = RemapBuffers(slots, per_slot, fixed)
    return out


def to_meta(buffers: dict[str, RemapBuffers]) -> dict[str, list[int]]:
    """As a plan's meta keeps them (`plan show` adds them to its report again)."""
    return {t: [b.slots, b.bytes_per_slot, b.fixed_bytes] for t, b in buffers.items()}


def from_meta(meta: dict) -> dict[str, RemapBuffers]:
    return {t: RemapBuffers(*map(int, v)) for t, v in (meta.get("remap_buffers") or {}).items()}


def add_to_report(report: dict, buffers: dict[str, RemapBuffers]) -> None:
    """Each MC table's row gets `remap_host_bytes` (and each shard its own); the report gets
    `host_remap_bytes_per_rank`, the remap's host memory on every rank, and its meta the buffers."""
    if not buffers:
        return
    report["meta"]["remap_buffers"] = to_meta(buffers)
    per_rank = [0] * int(report["world_size"])
    for row in report["tables"]:
        b = buffers.get(row["name"])
        if b is None:
            continue
        total = 0
        for shard in row["shards"]:
            shard["remap_host_bytes"] = b.shard_bytes(int(shard["sizes"][0]))
            per_rank[shard["rank"]] += shard["remap_host_bytes"]
            total += shard["remap_host_bytes"]
        row["remap_host_bytes"] = total
    report["host_remap_bytes_per_rank"] = per_rank
