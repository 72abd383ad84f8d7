"""Which tables go to the host tier, in TorchRec's words (docs/host_tier.md).

TorchRec puts a table in host memory behind a device cache with compute kernel `fused_uvm_caching`
and the table's `CacheParams` (load factor, algorithm). tpurec reads the same words: a table whose
ParameterConstraints list `fused_uvm_caching` among its compute kernels, or which a given plan puts
on it, runs on tpurec's kernel with its rows on the host tier. In the plan such a table is on
tpurec's kernel (`customized_kernel`, what TorchRec's sharded modules need to leave the table to it)
with its `cache_params` set: that pair is what the sharded modules read (`host_tier_tables`). TorchRec
copies a constraint's cache_params into every table's plan whatever its kernel, so tables that did
not ask for the caching kernel have theirs cleared (`mark_host_tier`).

The planner (`planners.plan`) takes the constraints as given, costs those tables as their caches on
the device and whole in host memory (host_tier_cost.py), and, asked to, moves tables there itself
(host_tier_plan.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import cast

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams, ParameterSharding, ShardingPlan

from tpurec.planner.kernel_choice import COMPUTE_KERNEL

HOST_TIER_KERNEL = EmbeddingComputeKernel.FUSED_UVM_CACHING.value


def host_tier_requests(constraints: Mapping[str, ParameterConstraints] | None) -> dict[str, CacheParams]:
    """{table: its CacheParams (TorchRec's defaults when none)} for the tables whose constraints name
    `fused_uvm_caching` among their compute kernels."""
    return {
        name: c.cache_params or CacheParams()
        for name, c in (constraints or {}).items()
        if HOST_TIER_KERNEL in (c.compute_kernels or ())
    }


def planning_constraints(
    constraints: Mapping[str, ParameterConstraints] | None,
) -> dict[str, ParameterConstraints] | None:
    """The constraints as tpurec's planner takes them: `fused_uvm_caching` is tpurec's own kernel (with
    the host tier, which `mark_host_tier` sets on the plan). Copies; the caller's are left alone."""
    if constraints is None:
        return None
    out = dict(constraints)
    for name, c in constraints.items():
        kernels = list(c.compute_kernels or ())
        if HOST_TIER_KERNEL in kernels:
            replaced = [COMPUTE_KERNEL if k == HOST_TIER_KERNEL else k for k in kernels]
            out[name] = copy.copy(c)
            out[name].compute_kernels = list(dict.fromkeys(replaced))
    return out


def mark_host_tier(plan: ShardingPlan, requests: Mapping[str, CacheParams]) -> None:
    """In place: every table of `plan` on tpurec's kernel gets its requested CacheParams (host tier),
    or none (resident)."""
    for module_plan in plan.plan.values():
        # (an embedding module's plan is a dict of its tables; TorchRec types it by its base class)
        for name, ps in cast(Mapping[str, ParameterSharding], module_plan).items():
            if ps.compute_kernel == COMPUTE_KERNEL:
                ps.cache_params = requests.get(name)


def host_tier_tables(params: Mapping[str, ParameterSharding]) -> dict[str, CacheParams]:
    """{table: CacheParams} of a sharded module's tables on the host tier: on tpurec's kernel with cache_params."""
    return {
        name: ps.cache_params
        for name, ps in params.items()
        if ps.compute_kernel == COMPUTE_KERNEL and ps.cache_params is not None
    }
