"""How many tables tpurec plans, alone and times the devices: checked before planning starts (for
`tpurec plan --tables`, before torch loads), so a problem too large is one line at once.

With the proposers' work budget (proposal_budget.py) planning time and memory grow about linearly
with tables and with tables x devices (every row-wise option holds a shard per device). CPU seconds
of the whole command on a 2-core host (docs/results.md, planning time): 3,000 tables on 64 devices
132 s and 1.2 GB; 26 tables on 18,432 devices (the most devices tpurec plans,
topology.MAX_PLAN_DEVICES) 63 s and 1.8 GB. The bounds keep a plan within a few minutes and a few GB.
"""

from __future__ import annotations

MAX_PLAN_TABLES = 4096
# Tables x devices: 26 tables on the largest slice (479,232) and 3,000 tables on 64 devices fit.
MAX_PLAN_TABLE_DEVICES = 2**19


def tables_problem(tables: int, devices: int | None = None) -> str | None:
    """Why `tables` tables (on `devices` devices, when known) are more than tpurec plans, or None."""
    if tables > MAX_PLAN_TABLES:
        return f"{tables:,} tables; tpurec plans at most {MAX_PLAN_TABLES:,} (planning time grows with tables)"
    if devices is not None and tables * devices > MAX_PLAN_TABLE_DEVICES:
        return (
            f"{tables:,} tables on {devices:,} devices; tpurec plans at most {MAX_PLAN_TABLE_DEVICES:,} tables x "
            f"devices (at most {MAX_PLAN_TABLE_DEVICES // devices:,} tables on {devices:,} devices: every row-wise "
            "option holds a shard per device)"
        )
    return None
