"""The smallest Cloud TPU slice, per generation, on which a model's tables fit.

Asked when a plan is refused (`tpurec plan` reports it as `smallest_fitting_topology`): the slice
sizes of `topology.slice_names` are tried smallest first, those whose memory cannot hold the tables'
weights and optimizer state are skipped without planning, and the first size the planner places is
the answer. Single slices only (multislice adds DCN, not memory per device).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from tpurec.embedding.optimizers.registry import spec_class
from tpurec.planner import planners as P
from tpurec.planner.estimators import table_elem_bytes
from tpurec.planner.plan_bounds import tables_problem
from tpurec.planner.topology import make_topology, parse_slice, slice_names

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.planner.id_limits import IdLimits

# The generations tpurec's kernel runs on (v4 and v5e have no usable SparseCore).
TPU_GENERATIONS = ("v5p", "v6e", "v7x")
# Slice sizes the planner is asked about per generation before giving up: each attempt is a full
# planning run, and a size that the memory bound admits but the planner refuses is rare.
MAX_ATTEMPTS = 3


def memory_lower_bound(module: nn.Module, optimizer: str) -> int:
    """Bytes no TPU plan can go below: weights and optimizer state, twice (the fused update's
    transient new table and state, counted per shard by the estimators)."""
    return 2 * sum(
        cfg.num_embeddings * cfg.embedding_dim * table_elem_bytes(cfg.data_type, "tpu")
        + spec_class(optimizer).state_bytes(cfg.num_embeddings, cfg.embedding_dim)
        for cfg in P._table_configs(module)
    )


def smallest_fitting_topology(
    module: nn.Module,
    *,
    batch_size: int,
    optimizer: str,
    constraints: dict[str, ParameterConstraints] | None = None,
    headroom_fraction: float = P.DEFAULT_HEADROOM_FRACTION,
    generations: Iterable[str] = TPU_GENERATIONS,
    limits: IdLimits | None = None,
    **assumptions: Any,
) -> dict[str, str | None]:
    """{generation: the smallest slice name the planner fits the model on, or None}."""
    need = memory_lower_bound(module, optimizer)
    out: dict[str, str | None] = {}
    for gen in generations:
        out[gen], attempts = None, 0
        for name in slice_names(gen):
            spec = parse_slice(name)
            if tables_problem(len(P._table_configs(module)), spec.world_size):
                break  # more tables x devices than tpurec plans: larger slices are no answer either
            reservation = P.TpuStorageReservation(headroom_fraction=headroom_fraction)
            cap = spec.generation.hbm_bytes
            if spec.world_size * (cap - reservation.amount(module, batch_size, cap)) < need:
                continue  # too small whatever the placement: no planning run
            try:
                P.plan(
                    module,
                    make_topology(name, **assumptions),
                    batch_size=batch_size,
                    optimizer=optimizer,
                    constraints=constraints,
                    storage_reservation=reservation,
                    limits=limits,
                )
            except P.PlanDoesNotFit:
                attempts += 1
                if attempts >= MAX_ATTEMPTS:
                    break
                continue
            out[gen] = name
            break
    return out
