"""`tpurec bench plan --calibrate`: the CPU cost model against measured training steps.

CPU is the one place here where the planner's cost model can be checked against a clock. Several
plans of dlrm-tiny at 2 ranks (gloo, one thread each, the same synthetic data and batch) are each
trained for a few hundred steps by `tpurec.bench.train`'s worker; for each, the embedding step time
the model estimates (`inspect.build_report` on `cpu-2`, what the planner minimises) is set against
the measured time per training step. Reported: the Spearman rank correlation of the two (does the
model order plans as the clock does?), the worst relative error (the model counts only the
embedding part of a step, with nominal host bandwidths, so its absolute figures are not expected to
match), and how the planner's CPU choice (what `tpurec train` runs) compares with round-robin
table-wise.
"""

from __future__ import annotations

import os
import sys
import tempfile

MODEL = "dlrm-tiny"
WORLD = 2
OPTIMIZER = "rowwise_adagrad"  # dlrm-tiny's training config (catalog.TRAINING_DEFAULTS)


def candidate_plans(world: int = WORLD) -> dict:
    """{name: ShardingPlan} of dlrm-tiny on `world` CPU ranks: placements a user might try, the
    planner's own choices, and deliberately poor ones, so the ranking has a spread to order."""
    import dataclasses

    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    from tpurec.catalog import get_table_set
    from tpurec.sharding import planner as P
    from tpurec.sharding.inspect import tables_module
    from tpurec.sharding.kernel_choice import COMPUTE_KERNEL, CPU_TRAINING_SHARDING_TYPES
    from tpurec.sharding.sharder import SparseCoreEBCSharder
    from tpurec.sharding.topology import make_topology

    tables = list(get_table_set(MODEL).tables)
    ebc = tables_module(tables)
    names = [t.name for t in tables]
    big = {t.name for t in tables if t.num_embeddings >= 1000}

    def by_hand(choose) -> ShardingPlan:
        plan = construct_module_sharding_plan(
            ebc,
            per_param_sharding={n: choose(i, n) for i, n in enumerate(names)},
            local_size=world,
            world_size=world,
            device_type="cpu",
            sharder=SparseCoreEBCSharder(num_sparsecores=4),
        )
        return ShardingPlan({"": {n: dataclasses.replace(ps, compute_kernel=COMPUTE_KERNEL) for n, ps in plan.items()}})

    ranks = list(range(world))
    plans = {
        "table_wise round-robin": by_hand(lambda i, n: table_wise(rank=i % world)),
        "table_wise all on rank 0": by_hand(lambda i, n: table_wise(rank=0)),
        "table_wise 3:1": by_hand(lambda i, n: table_wise(rank=1 if i % 4 == 3 else 0)),
        "row_wise all": by_hand(lambda i, n: row_wise()),
        "column_wise all": by_hand(lambda i, n: column_wise(ranks=ranks)),
        "row_wise big, table_wise small": by_hand(lambda i, n: row_wise() if n in big else table_wise(rank=i % world)),
        "column_wise big, table_wise small": by_hand(
            lambda i, n: column_wise(ranks=ranks) if n in big else table_wise(rank=i % world)
        ),
        "table_wise and row_wise alternating": by_hand(
            lambda i, n: row_wise() if i % 2 else table_wise(rank=i % 4 // 2)
        ),
    }
    pooling = P.pooling_constraints({t.name: t.pooling_factor for t in tables})
    from torchrec.distributed.planner.types import ParameterConstraints

    cpu_only = P.pooling_constraints(
        {t.name: t.pooling_factor for t in tables},
        base={n: ParameterConstraints(sharding_types=list(CPU_TRAINING_SHARDING_TYPES)) for n in names},
    )
    topo = make_topology(f"cpu-{world}")
    batch = _batch_size()
    plans["planner, CPU training's types"] = P.plan(
        ebc, topo, batch_size=batch, constraints=cpu_only, optimizer=OPTIMIZER
    )
    plans["planner, every type"] = P.plan(ebc, topo, batch_size=batch, constraints=pooling, optimizer=OPTIMIZER)
    return plans


def _batch_size() -> int:
    from tpurec.catalog import TRAINING_DEFAULTS

    return TRAINING_DEFAULTS[MODEL].batch_size


def estimated_ms(plan, world: int = WORLD) -> float:
    from tpurec.catalog import get_table_set
    from tpurec.sharding.inspect import build_report
    from tpurec.sharding.topology import cpu_spec

    report = build_report(
        plan,
        get_table_set(MODEL).tables,
        cpu_spec(world),
        batch_size=_batch_size(),
        optimizer=OPTIMIZER,
        compute_device="cpu",
    )
    return report["estimated_step_time_ms"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def _measure(plan_file: str, data, steps: int, warmup: int) -> dict:
    """One 2-rank training run of dlrm-tiny on `plan_file` (the `tpurec bench train` launcher)."""
    from tpurec.bench.train import launch

    return launch("tpurec", data, WORLD, steps, warmup, _batch_size(), extra=["--plan", plan_file])


def run(steps: int = 200, warmup: int = 20, only: int | None = None) -> dict:
    """Measure every candidate plan (the first `only` of them if given) and compare."""
    from tpurec.dlrm.data import ensure_synth
    from tpurec.sharding.plan_io import save_plan

    plans = candidate_plans()
    if only is not None:
        plans = dict(list(plans.items())[:only])
    batch = _batch_size()
    rows = max(100_000, int((steps + warmup) * batch * WORLD * 1.1) + 1)
    data = ensure_synth(MODEL, rows, 0, say=lambda m: print(m, file=sys.stderr))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans.items()):
            path = os.path.join(tmp, f"plan{i}.json")
            save_plan(plan, path)
            m = _measure(path, data, steps, warmup)
            measured = 1e3 * m["seconds"] / steps
            est = estimated_ms(plan)
            out.append(
                {
                    "plan": name,
                    "estimated_ms": round(est, 4),
                    "measured_ms": round(measured, 3),
                    "rel_error": round(abs(est - measured) / measured, 4),
                    "samples_per_s": m["samples_per_s"],
                    "shardings": m["plan"],
                }
            )
            print(f"{name}: estimated {est:.3f} ms, measured {measured:.2f} ms per step", file=sys.stderr)
    est, meas = [r["estimated_ms"] for r in out], [r["measured_ms"] for r in out]
    by_name = {r["plan"]: r for r in out}
    result = {
        "model": MODEL,
        "nproc": WORLD,
        "batch_size_per_rank": batch,
        "steps": steps,
        "warmup": warmup,
        "threads_per_rank": 1,
        "plans": out,
        "spearman": round(spearman(est, meas), 3),
        "max_rel_error": round(max(r["rel_error"] for r in out), 4),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    choice, baseline = by_name.get("planner, CPU training's types"), by_name.get("table_wise round-robin")
    if choice and baseline:
        result["planner_choice_vs_round_robin"] = round(baseline["measured_ms"] / choice["measured_ms"], 3)
    return result
