"""`tpurec train --zch`: the DLRM's tables behind TorchRec's managed-collision remap, and its counters.

With --zch the model's EmbeddingBagCollection becomes TorchRec's `ManagedCollisionEmbeddingBagCollection`
with one `MCHManagedCollisionModule` per table: `zch_size` is the table's rows (from the model config,
or the data's sizes), the eviction policy is `--zch-eviction`, evictions run every
`--zch-eviction-interval` steps. The data must hold raw ids (`tpurec data convert --raw-ids`,
`tpurec data synth --raw-ids`): the remap replaces the modulo hash the reader applies otherwise.

Raw ids first go through `spread_ids`, a bijection of [0, 2**63 - 1) (an odd multiplier, modulo
2**63), as the remap's `input_hash_func`: TorchRec's row-wise remap sends an id to the rank owning its
block of the input range, and Criteo's raw ids (< 2**32) would otherwise all land in rank 0's block.

`RemapCounters` reads the remap's work from TorchRec's MCH modules on this rank (after sharding: this
rank's shard of each table) and sums them over the ranks: ids remapped and how many found their own
slot (hits; the rest share the table's last row), slots taken by new ids (admitted) and of those the
ones that pushed an id out (evictions), and the occupancy (ids held / usable slots, from the module's
`_mch_sorted_raw_ids`; TorchRec keeps one slot per shard free as its sorted array's end marker, so
a shard of `n` rows holds at most `n - 1` ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpurec.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

POLICIES = ("lru", "lfu", "distance_lfu")
DEFAULT_EVICTION_INTERVAL = 10  # steps between evictions (new ids wait for the next one in the shared row)
INPUT_HASH_SIZE = 2**63 - 1  # the remap's input range (TorchRec's default)
_SPREAD = 0x9E3779B97F4A7C15 - 2**64  # odd: a bijection modulo 2**64 and 2**63 (as int64)
_EMPTY = 2**63 - 1  # TorchRec's marker of an unused slot in _mch_sorted_raw_ids
RAW_IDS_FIX = "convert with `tpurec data convert --raw-ids` or make data with `tpurec data synth --raw-ids`"


@dataclass(frozen=True)
class ZchSpec:
    """What --zch asks for: the eviction policy and interval (the slots are the tables' rows)."""

    eviction: str = "lru"
    eviction_interval: int = DEFAULT_EVICTION_INTERVAL

    def record(self) -> dict:
        """As a limits file records the remap its ids were counted after (tpurec.planner.id_limits)."""
        return {"eviction": self.eviction, "eviction_interval": self.eviction_interval}


def remap_rows(rows: int, world_size: int) -> int:
    """The rows of a managed-collision table of `rows` at `world_size` ranks: `rows` when every rank's
    row-wise block (TorchRec's: ceil(rows / ranks) each, the last ranks what is left) has >= 2 rows (one id
    and TorchRec's end marker; a block of 0 rows fails TorchRec's `zch_size > 0`), else rounded up to
    equal blocks of at least 2 rows."""
    block = -(-rows // world_size)
    if rows - (world_size - 1) * block >= 2:
        return rows
    return max(2, block) * world_size


def spread_ids(values: torch.Tensor, input_hash_size: int) -> torch.Tensor:
    """Raw ids spread over [0, input_hash_size): multiplied by an odd constant (int64 wraps), the sign
    bit dropped, then modulo `input_hash_size` (only 2**63 - 1, TorchRec's empty-slot marker, folds
    onto 0). Distinct raw ids in [0, 2**63) stay distinct but for that one pair."""
    return ((values * _SPREAD) & (2**63 - 1)) % input_hash_size


def data_problem(data_dir: str) -> str | None:
    """Why --zch cannot train on `data_dir` (one line naming the flag and the fix), or None."""
    from tpurec.data.schema import dataset_metadata

    try:
        meta = dataset_metadata(data_dir)
    except Exception:  # an unreadable dataset is named by the data checks
        return None
    sparse = meta.get("sparse", [])
    hashed = [f["name"] for f in sparse if f.get("num_embeddings") is not None]
    if hashed:
        return (
            f"--zch trains on raw ids, but {data_dir} holds ids hashed into table rows "
            f"({meta.get('categorical', '?')}, e.g. {hashed[0]}): {RAW_IDS_FIX}"
        )
    return None


def _policy(name: str) -> Any:
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

    return {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}[name]()


def mch_module(table: str, rows: int, spec: ZchSpec) -> Any:
    """The (unsharded) remap of one table of `rows` slots: TorchRec's MCHManagedCollisionModule as
    --zch builds it; sharding rebuilds it per rank (`rebuild_with_output_id_range`)."""
    import torch
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return MCHManagedCollisionModule(
        zch_size=rows,
        device=torch.device("cpu"),
        eviction_policy=_policy(spec.eviction),
        eviction_interval=spec.eviction_interval,
        input_hash_size=INPUT_HASH_SIZE,
        input_hash_func=spread_ids,
        name=table,
    )


def managed_collision_ebc(ebc: Any, spec: ZchSpec) -> nn.Module:
    """`ebc` (a meta-device EmbeddingBagCollection) behind TorchRec's remap, one MCH module per table:
    TorchRec's ManagedCollisionEmbeddingBagCollection (tpurec.dlrm.model wraps it for DLRM)."""
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    if spec.eviction not in POLICIES:
        raise UserError(f"--zch-eviction {spec.eviction}: one of {', '.join(POLICIES)}")
    configs = ebc.embedding_bag_configs()
    small = [c for c in configs if c.num_embeddings < 2]
    if small:
        raise UserError(f"--zch: table {small[0].name} has {small[0].num_embeddings} row(s); a remap needs >= 2")
    modules: dict[str, Any] = {c.name: mch_module(c.name, c.num_embeddings, spec) for c in configs}
    remap = ManagedCollisionCollection(managed_collision_modules=modules, embedding_configs=configs)
    return ManagedCollisionEmbeddingBagCollection(ebc, remap, return_remapped_features=False)


@dataclass
class _Table:
    """One MCH module's counts on this rank."""

    name: str
    module: Any
    ids: int = 0
    hits: int = 0
    eval_ids: int = 0
    eval_hits: int = 0
    admitted: int = 0
    evictions: int = 0


class RemapCounters:
    """Counts the remap's work on every MCH module of a (sharded) model: `attach(dmp)` once after
    sharding, then `figures()` on every rank at the same points (it sums over the ranks). `spec`:
    --zch's; None for a --model-module's own modules (their policy and interval read off them)."""

    FIELDS = ("ids", "hits", "eval_ids", "eval_hits", "admitted", "evictions", "occupied", "slots")

    def __init__(self, spec: ZchSpec | None) -> None:
        self.spec = spec
        self.tables: list[_Table] = []
        self.uncounted: list[str] = []  # tables behind another kind of remap (HashZch): not counted

    def attach(self, model: nn.Module) -> RemapCounters:
        from torchrec.modules.mc_modules import MCHManagedCollisionModule

        for owner in model.modules():
            mcms = getattr(owner, "_managed_collision_modules", None)
            if mcms is None:
                continue
            for name, mcm in mcms.items():
                if not isinstance(mcm, MCHManagedCollisionModule):  # no sorted ids, no eviction policy to read
                    self.uncounted.append(name)
                    continue
                mch: Any = mcm  # its methods wrapped below
                table = _Table(name, mch)
                mch.remap = self._counting_remap(table, mch.remap)
                mch._update_and_evict = self._counting_update(table, mch._update_and_evict)
                self.tables.append(table)
        if not self.tables and self.spec is not None:
            raise RuntimeError("--zch: no managed-collision module found in the sharded model")
        return self

    def policy(self) -> tuple[str, int | None]:
        """(eviction policy, interval): --zch's, or the model's modules' ("lru", "lfu", "distance_lfu",
        else the class name; several joined by commas; the interval None when they differ)."""
        if self.spec is not None:
            return self.spec.eviction, self.spec.eviction_interval
        names = {"LRU_EvictionPolicy": "lru", "LFU_EvictionPolicy": "lfu", "DistanceLFU_EvictionPolicy": "distance_lfu"}
        kinds = sorted(
            {names.get(type(p).__name__, type(p).__name__) for p in (t.module._eviction_policy for t in self.tables)}
        )
        intervals = {int(t.module._eviction_interval) for t in self.tables}
        return ",".join(kinds), (intervals.pop() if len(intervals) == 1 else None)

    @staticmethod
    def _counting_remap(table: _Table, remap: Callable) -> Callable:
        def counted(features: dict, *args: Any, **kwargs: Any) -> Any:
            import torch

            sorted_ids = table.module._mch_sorted_raw_ids
            n = hits = 0
            for jt in features.values():
                values = jt.values()
                found = sorted_ids[torch.searchsorted(sorted_ids[:-1], values)] == values  # as TorchRec matches
                n += int(values.numel())
                hits += int(found.sum())
            if table.module.training:
                table.ids += n
                table.hits += hits
            else:
                table.eval_ids += n
                table.eval_hits += hits
            return remap(features, *args, **kwargs)

        return counted

    @staticmethod
    def _counting_update(table: _Table, update: Callable) -> Callable:
        """TorchRec's eviction step, with its policy's choice of slots counted: every slot it hands to
        a new id is admitted, and evicted if an id held it."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            mcm = table.module
            policy = mcm._eviction_policy
            choose = policy.update_metadata_and_generate_eviction_scores

            def counting_choose(*a: Any, **k: Any) -> Any:
                evicted, selected = choose(*a, **k)
                table.admitted += int(evicted.numel())
                table.evictions += int((mcm._mch_sorted_raw_ids[evicted] != _EMPTY).sum())
                return evicted, selected

            policy.update_metadata_and_generate_eviction_scores = counting_choose
            try:
                return update(*args, **kwargs)
            finally:
                del policy.update_metadata_and_generate_eviction_scores  # the class's method again

        return counted

    def reset_eval(self) -> None:
        """Zero the eval counts (each evaluation reports its own)."""
        for t in self.tables:
            t.eval_ids = t.eval_hits = 0

    def _local(self) -> list[list[int]]:
        rows = []
        for t in self.tables:
            occupied = int((t.module._mch_sorted_raw_ids != _EMPTY).sum())
            slots = int(t.module._mch_slots)
            rows.append([t.ids, t.hits, t.eval_ids, t.eval_hits, t.admitted, t.evictions, occupied, slots])
        return rows

    def per_table(self, world_size: int) -> dict[str, dict[str, int | float]]:
        """{table: its counts summed over the ranks, with `occupancy` = occupied / slots}."""
        import torch

        counts = torch.tensor(self._local(), dtype=torch.int64)
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        out: dict[str, dict[str, int | float]] = {}
        for t, row in zip(self.tables, counts.tolist()):
            figures: dict[str, int | float] = dict(zip(self.FIELDS, row))
            figures["occupancy"] = round(row[6] / max(1, row[7]), 6)
            out[t.name] = figures
        return out

    def figures(self, world_size: int) -> dict[str, Any]:
        """The totals over tables and ranks (collective when world_size > 1), for the result line."""
        tables = self.per_table(world_size)
        total = {k: sum(int(t[k]) for t in tables.values()) for k in self.FIELDS}
        eviction, interval = self.policy()
        return {
            "eviction": eviction,
            "eviction_interval": interval,
            "remapped_ids": total["ids"],
            "remap_hits": total["hits"],
            "hit_rate": round(total["hits"] / total["ids"], 6) if total["ids"] else None,
            "eval_remapped_ids": total["eval_ids"],
            "eval_hit_rate": round(total["eval_hits"] / total["eval_ids"], 6) if total["eval_ids"] else None,
            "admitted": total["admitted"],
            "evictions": total["evictions"],
            "occupied_slots": total["occupied"],
            "slots": total["slots"],
            "occupancy": round(total["occupied"] / max(1, total["slots"]), 6),
            "tables_full": sum(1 for t in tables.values() if t["occupied"] >= t["slots"]),
        }
