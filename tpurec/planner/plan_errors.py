"""The planner's refusal, in a module of its own: the planner (planners.py) raises it, and so does the
host tier's choice (host_tier_plan.py), which the planner calls."""

from __future__ import annotations

from tpurec.errors import UserError


class PlanDoesNotFit(UserError):
    """The tables cannot be placed in the devices' memory; the message says by how much."""
