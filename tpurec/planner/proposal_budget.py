"""A work budget per proposer, so planning time grows about linearly with tables and devices.

TorchRec's planner partitions and rates every proposal, and each costs time in proportion to the
shards it holds (every shard of every table is copied, hashed and placed): tables x devices for
row-wise options. Its proposers make many proposals: the greedy ones about (options - 1) per table,
the grid search up to 10,000. Unbounded, planning time grows as tables^2 x devices, and with the
grid search as 2^tables x devices (the runs with and without the budget: docs/results.md, planning
time).

`Budgeted` wraps one proposer and stops it once its proposals have held `budget` shards, once some
proposer has found a plan that fits. Until then it may go on to `NO_FIT_FACTOR` budgets; a search
stopped there without any fit is not reported as "does not fit" but as a bound reached
(`SearchBoundReached`, raised by planner.plan); a later proposer may still find one (the uniform
proposals, every table row-wise or every table table-wise, fit whenever a spread placement does).
The budget is deterministic (counted in shards, not seconds), so the same inputs give the same plan
on any machine, and it is large enough that the plans of tpurec's table sets on the slices of
docs/planner.md are unchanged (criteo-kaggle on v6e-256, the largest, uses 260,000 per proposer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from torchrec.distributed.planner.types import Proposer, ShardingOption, Topology

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import Enumerator

# Shards a proposer's proposals may hold in all once a plan fits: ~7 s of partitioning on a 2-core
# host (about 24 us per shard, profiled on 100 tables), above the 260,000 that the
# largest of tpurec's table sets uses (criteo-kaggle on v6e-256), whose plans it leaves unchanged.
DEFAULT_SHARD_BUDGET = 300_000
# Budgets a proposer may spend while no proposal has fit yet (the greedy proposers move one table
# per proposal: tables^2 x devices without a bound).
NO_FIT_FACTOR = 4


class SearchBoundReached(UserError):
    """No proposal fit before every proposer had spent its bound: the tables may still fit."""


class PlanFound:
    """Shared by the proposers of one planner: whether any proposal fit yet, and whether a proposer
    stopped at its bound before any did (both reset on load)."""

    def __init__(self) -> None:
        self.found = False
        self.bounded = False


class Budgeted(Proposer):
    """`inner`, stopped once its proposals held `budget` shards and a plan has been found."""

    def __init__(self, inner: Proposer, state: PlanFound, budget: int = DEFAULT_SHARD_BUDGET) -> None:
        self.inner, self._state, self._budget = inner, state, budget
        self._spent = 0

    def load(self, search_space: List[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._spent = 0
        self._state.found = self._state.bounded = False  # every proposer is loaded before the first proposal
        self.inner.load(search_space=search_space, enumerator=enumerator)

    def propose(self) -> List[ShardingOption] | None:
        if self._spent >= self._budget and self._state.found:
            return None
        if self._spent >= self._budget * NO_FIT_FACTOR:
            self._state.bounded = True
            return None
        proposal = self.inner.propose()
        if proposal:
            self._spent += sum(len(o.shards) for o in proposal)
        return proposal

    def feedback(
        self,
        partitionable: bool,
        plan: List[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if partitionable and plan:
            self._state.found = True
        self.inner.feedback(
            partitionable=partitionable, plan=plan, perf_rating=perf_rating, storage_constraint=storage_constraint
        )


def budgeted(proposers: List[Proposer], budget: int = DEFAULT_SHARD_BUDGET) -> List[Proposer]:
    """`proposers`, each under its own budget, sharing whether a plan was found."""
    state = PlanFound()
    return [Budgeted(p, state, budget) for p in proposers]


def bound_reached(proposers: List[Proposer]) -> bool:
    """Whether a search of these (budgeted) proposers that found no plan stopped at a bound."""
    return any(isinstance(p, Budgeted) and p._state.bounded for p in proposers)
