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
ROUND_ROBIN = "table_wise round-robin"
PLANNER = "planner, CPU training's types"  # what `tpurec train` runs on cpu-2


def candidate_plans(world: int = WORLD) -> dict:
    """{name: ShardingPlan} of dlrm-tiny on `world` CPU ranks: placements a user might try, the
    planner's own choices, and deliberately poor ones, so the ranking has a spread to order."""
    import dataclasses

    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
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
    every = (
        lambda i: table_wise(rank=i // 4 % world),
        lambda i: row_wise(),
        lambda i: column_wise(ranks=ranks),
        lambda i: table_row_wise(host_index=0),
    )
    plans = {
        ROUND_ROBIN: by_hand(lambda i, n: table_wise(rank=i % world)),
        "table_wise all on rank 0": by_hand(lambda i, n: table_wise(rank=0)),
        "table_wise 3:1": by_hand(lambda i, n: table_wise(rank=1 if i % 4 == 3 else 0)),
        "row_wise all": by_hand(lambda i, n: row_wise()),
        "column_wise all": by_hand(lambda i, n: column_wise(ranks=ranks)),
        "column_wise 4 shards": by_hand(lambda i, n: column_wise(ranks=ranks * 2)),
        "row_wise big, table_wise small": by_hand(lambda i, n: row_wise() if n in big else table_wise(rank=i % world)),
        "column_wise big, table_wise small": by_hand(
            lambda i, n: column_wise(ranks=ranks) if n in big else table_wise(rank=i % world)
        ),
        "table_wise and row_wise alternating": by_hand(
            lambda i, n: row_wise() if i % 2 else table_wise(rank=i % 4 // 2)
        ),
        "four sharding types": by_hand(lambda i, n: every[i % 4](i)),
    }
    pooling = P.pooling_constraints({t.name: t.pooling_factor for t in tables})
    from torchrec.distributed.planner.types import ParameterConstraints

    cpu_only = P.pooling_constraints(
        {t.name: t.pooling_factor for t in tables},
        base={n: ParameterConstraints(sharding_types=list(CPU_TRAINING_SHARDING_TYPES)) for n in names},
    )
    topo = make_topology(f"cpu-{world}")
    batch = _batch_size()
    plans[PLANNER] = P.plan(ebc, topo, batch_size=batch, constraints=cpu_only, optimizer=OPTIMIZER)
    plans["planner, every type"] = P.plan(ebc, topo, batch_size=batch, constraints=pooling, optimizer=OPTIMIZER)
    return plans


def _batch_size() -> int:
    from tpurec.catalog import TRAINING_DEFAULTS

    return TRAINING_DEFAULTS[MODEL].batch_size


FIT_PLANS = (ROUND_ROBIN, "row_wise all", "table_wise and row_wise alternating", "four sharding types")


def estimate(plan, costs=None, world: int = WORLD) -> dict:
    """The CPU cost model's step of `plan` (cpu_cost.step_ms on the `cpu-N` report: what it consists of)."""
    from tpurec.catalog import get_table_set
    from tpurec.sharding import cpu_cost
    from tpurec.sharding.inspect import build_report
    from tpurec.sharding.topology import cpu_spec

    costs = costs or cpu_cost.DEFAULT_CPU_COSTS
    report = build_report(
        plan,
        get_table_set(MODEL).tables,
        cpu_spec(world, cpu_costs=costs),
        batch_size=_batch_size(),
        optimizer=OPTIMIZER,
        compute_device="cpu",
    )
    out = cpu_cost.step_ms(report, costs)
    out["embedding_ms"] = report["estimated_step_time_ms"]  # the per-shard part, what the planner balances
    return out


def estimated_ms(plan, costs=None, world: int = WORLD) -> float:
    return estimate(plan, costs, world)["step_ms"]


def fit_fixed_terms(parts: dict, measured: dict, names=FIT_PLANS) -> dict:
    """Least-squares step_fixed_ms and group_fixed_ms (>= 0) from the fit plans: measured = step_fixed
    + groups * group_fixed + the micro-measured rest of the model."""
    rows = [
        (
            len(parts[n]["groups"]),
            measured[n] - (parts[n]["step_ms"] - parts[n]["step_fixed_ms"] - parts[n]["group_fixed_ms"]),
        )
        for n in names
    ]
    n = len(rows)
    mg, my = sum(g for g, _ in rows) / n, sum(y for _, y in rows) / n
    var = sum((g - mg) ** 2 for g, _ in rows)
    slope = max(0.0, sum((g - mg) * (y - my) for g, y in rows) / var) if var else 0.0
    return {"step_fixed_ms": round(my - slope * mg, 3), "group_fixed_ms": round(slope, 3)}


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


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2


def _stats(est: dict, meas: dict, names) -> dict:
    names = list(names)
    e, m = [est[n] for n in names], [meas[n] for n in names]
    return {
        "plans": len(names),
        "spearman": round(spearman(e, m), 3),
        "max_rel_error": round(max(abs(a - b) / b for a, b in zip(e, m)), 4),
    }


def score(plans: dict, rounds: list[dict], costs) -> dict:
    """Compare the model with measured step times. `rounds`: per round {plan: measured ms}. The two
    fixed terms are fitted on FIT_PLANS (their medians); the others are the held-out plans."""
    medians = {n: _median([r[n] for r in rounds]) for n in plans}
    parts = {n: estimate(p, costs) for n, p in plans.items()}
    fitted = costs.with_measured(**fit_fixed_terms(parts, medians))
    parts = {n: estimate(p, fitted) for n, p in plans.items()}
    est = {n: parts[n]["step_ms"] for n in plans}
    held_out = [n for n in plans if n not in FIT_PLANS]
    rows = [
        {
            "plan": n,
            "fit": n in FIT_PLANS,
            "groups": parts[n]["groups"],
            "kernels_per_rank": parts[n]["kernels_per_rank"],
            "estimated_ms": round(est[n], 3),
            "estimated_embedding_ms": round(parts[n]["embedding_ms"], 3),
            "measured_ms": round(medians[n], 3),
            "measured_rounds_ms": [round(r[n], 3) for r in rounds],
            "rel_error": round(abs(est[n] - medians[n]) / medians[n], 4),
        }
        for n in plans
    ]
    every = _stats(est, medians, plans)
    return {
        "plans": rows,
        "spearman": every["spearman"],
        "max_rel_error": every["max_rel_error"],
        "held_out": _stats(est, medians, held_out),
        "spearman_per_round": [_stats(est, r, plans)["spearman"] for r in rounds],
        # the embedding part alone (the planner's objective) against the clock: its ranking
        "spearman_embedding_part": round(
            spearman([parts[n]["embedding_ms"] for n in plans], [medians[n] for n in plans]), 3
        ),
        "costs": {k: getattr(fitted, k) for k in fitted.__dataclass_fields__},
        "planner_s": round(medians[PLANNER] / 1e3, 5),
        "round_robin_tw_s": round(medians[ROUND_ROBIN] / 1e3, 5),
        "planner_vs_round_robin_tw": round(medians[ROUND_ROBIN] / medians[PLANNER], 3),
        "planner_vs_round_robin_tw_per_round": [round(r[ROUND_ROBIN] / r[PLANNER], 3) for r in rounds],
        "planner_not_slower": medians[PLANNER] <= medians[ROUND_ROBIN],
        # the planner's slowest round is no slower than round-robin's fastest: a difference the noise
        # of this host cannot explain
        "planner_slower_beyond_noise": min(r[PLANNER] for r in rounds) > max(r[ROUND_ROBIN] for r in rounds),
    }


def _measure(plan_file: str, data, steps: int, warmup: int) -> dict:
    """One 2-rank training run of dlrm-tiny on `plan_file` (the `tpurec bench train` launcher)."""
    from tpurec.bench.train import launch

    return launch("tpurec", data, WORLD, steps, warmup, _batch_size(), extra=["--plan", plan_file])


def run(steps: int = 100, warmup: int = 20, rounds: int = 3, only: list[str] | None = None) -> dict:
    """Micro-measure the model's terms, train every candidate plan (`only`: those named) once per
    round, in turns (reversed order every other round, so drifting load falls on all), and score."""
    from tpurec.bench import cpu_costs
    from tpurec.dlrm.data import ensure_synth
    from tpurec.sharding.cpu_cost import DEFAULT_CPU_COSTS
    from tpurec.sharding.plan_io import save_plan

    plans = candidate_plans()
    if only is not None:
        plans = {n: plans[n] for n in only}
    batch = _batch_size()
    rows = max(100_000, int((steps + warmup) * batch * WORLD * 1.1) + 1)
    data = ensure_synth(MODEL, rows, 0, say=lambda m: print(m, file=sys.stderr))
    micro = cpu_costs.measure()
    measured, loads = [], []
    cpu = {name: [] for name in plans}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i, (name, plan) in enumerate(plans.items()):
            paths[name] = os.path.join(tmp, f"plan{i}.json")
            save_plan(plan, paths[name])
        # One short untimed run first: the first launch after a pause measured slow in the three
        # sessions here (e.g. 44.8 vs 25.5 ms for two equivalent plans), which would bias the plan that runs first.
        _measure(paths[next(iter(plans))], data, 5, 2)
        for r in range(rounds):
            order = list(plans) if r % 2 == 0 else list(plans)[::-1]
            times, load = {}, {}
            for name in order:
                m = _measure(paths[name], data, steps, warmup)
                times[name] = 1e3 * m["seconds"] / steps
                # CPU-seconds of both ranks per step: the work, which other jobs on the host disturb less
                cpu[name].append(1e3 * batch * WORLD / m["cpu_samples_per_s"])
                load[name] = round(os.getloadavg()[0], 2)
                print(f"round {r}: {name}: {times[name]:.2f} ms per step (load {load[name]})", file=sys.stderr)
            measured.append(times)
            loads.append(load)
    k, c = micro["kernel"], micro["collective"]
    here = DEFAULT_CPU_COSTS.with_measured(
        kernel_fixed_ms=k["kernel_fixed_ms"],
        per_id_us=k["per_id_us"],
        per_id_float_us=k["per_id_float_us"],
        collective_latency_ms=c["collective_latency_ms"],
        gloo_bytes_per_s=c["gloo_bytes_per_s"],
        host_cores=micro["parallel"]["parallel_ranks"],
    )
    scored = score(plans, measured, here)
    result = {
        "model": MODEL,
        "nproc": WORLD,
        "batch_size_per_rank": batch,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "threads_per_rank": 1,
        "micro": micro,
        # the model with this run's micro-measured terms (load as during the plans)
        **scored,
        # the same with the stored constants the planner plans with (cpu_cost.DEFAULT_CPU_COSTS)
        "with_stored_constants": {
            k: v for k, v in score(plans, measured, DEFAULT_CPU_COSTS).items() if k not in ("plans",)
        },
        "measured_cpu_ms_per_round": {n: [round(x, 3) for x in v] for n, v in cpu.items()},
        # the model's ranking against the CPU-seconds per step (the work; less disturbed by other jobs)
        "spearman_vs_cpu_time": round(
            spearman([p["estimated_ms"] for p in scored["plans"]], [_median(cpu[p["plan"]]) for p in scored["plans"]]),
            3,
        ),
        "load_average_per_round": loads,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    return result
