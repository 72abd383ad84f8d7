"""`--host-tier` of `tpurec plan` and `tpurec train`: which tables go on the host tier, in one flag.

    --host-tier auto                        the planner decides (tpurec plan's default: host_tier_plan.py)
    --host-tier off                         every table resident
    --host-tier t_C1[:0.1[:lfu]],t_C2       these tables, each with its load factor (default 0.2) and
                                            eviction (lru, the default, or lfu)

Explicit tables become TorchRec's words for them, ParameterConstraints(compute_kernels=
["fused_uvm_caching"], cache_params=CacheParams(...)) (host_tier_choice.py), merged into the
constraints the model already has. Parsed without torch, so a bad flag is refused at once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

AUTO, OFF = "auto", "off"
ALGORITHMS = ("lru", "lfu")


@dataclass(frozen=True)
class HostTierTable:
    name: str
    load_factor: float | None  # None: FBGEMM's default, 0.2
    algorithm: str | None  # None: LRU

    def cache_params(self) -> CacheParams:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
        from torchrec.distributed.types import CacheParams

        algorithm = CacheAlgorithm[self.algorithm.upper()] if self.algorithm else None
        return CacheParams(load_factor=self.load_factor, algorithm=algorithm)


def parse(text: str | None, flag: str = "--host-tier") -> str | list[HostTierTable] | None:
    """AUTO, None (off, or not given), or the tables named; a UserError naming the part that is wrong."""
    if text is None or text.strip().lower() == OFF:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    out: list[HostTierTable] = []
    for part in text.split(","):
        name, *rest = part.strip().split(":")
        if not name or len(rest) > 2:
            raise UserError(f"{flag} {text}: {part!r} is not TABLE[:LOAD_FACTOR[:lru|lfu]] (or use auto / off)")
        load_factor = None
        if rest and rest[0]:
            try:
                load_factor = float(rest[0])
            except ValueError:
                load_factor = math.nan
            if not (math.isfinite(load_factor) and 0 < load_factor <= 1):
                raise UserError(
                    f"{flag} {text}: load factor {rest[0]!r} of {name} is not a number in (0, 1] (the share of "
                    "its rows the cache holds)"
                )
        algorithm = rest[1].lower() if len(rest) > 1 else None
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise UserError(f"{flag} {text}: eviction {rest[1]!r} of {name} is not lru or lfu")
        if any(t.name == name for t in out):
            raise UserError(f"{flag} {text}: table {name} is named twice")
        out.append(HostTierTable(name, load_factor, algorithm))
    return out


def check_tables(tables: list[HostTierTable], known: list[str], flag: str = "--host-tier") -> None:
    """Refuse a table the model does not have, naming the model's tables."""
    unknown = [t.name for t in tables if t.name not in known]
    if unknown:
        shown = ", ".join(known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
        raise UserError(f"{flag}: no table {', '.join(unknown)} in the model (its tables: {shown})")


def with_host_tier(
    constraints: dict[str, ParameterConstraints] | None, tables: list[HostTierTable]
) -> dict[str, ParameterConstraints]:
    """`constraints` (copied) with each of `tables` on the host tier in TorchRec's words."""
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.planner.host_tier_choice import HOST_TIER_KERNEL

    out = dict(constraints or {})
    for t in tables:
        c = copy.copy(out.get(t.name) or ParameterConstraints())
        c.compute_kernels = [HOST_TIER_KERNEL]
        c.cache_params = t.cache_params()
        out[t.name] = c
    return out
