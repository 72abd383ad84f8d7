"""`tpurec bench plan --calibrate`: the CPU cost model against measured training steps.

CPU is the one place here where the planner's cost model can be checked against a clock. Twelve
plans of dlrm-tiny at 2 ranks (gloo, one thread each, the same synthetic data and batch) are trained
in one launch, taking turns in short blocks (`tpurec.bench.calibrate_worker`), so the host's drift
falls on all of them; for each, the step time the model estimates (`cpu_cost.step_ms` on the `cpu-2`
report) is set against the median measured step. Reported: the Spearman rank correlation of the two
(does the model order plans as the clock does?), the worst relative error, and, from a second
launch of those two plans alone, how the planner's CPU choice (what `tpurec train` runs) compares
with round-robin table-wise: the paired ratio with a 95% interval, and a non-inferiority verdict.
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
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan

    from tpurec.data.catalog import get_table_set
    from tpurec.planner import planners as P
    from tpurec.planner.kernel_choice import COMPUTE_KERNEL, CPU_TRAINING_SHARDING_TYPES
    from tpurec.planner.report import tables_module
    from tpurec.planner.topology import make_topology
    from tpurec.sharding.sharder import SparseCoreEBCSharder

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
        by_table = {n: dataclasses.replace(ps, compute_kernel=COMPUTE_KERNEL) for n, ps in plan.items()}
        return ShardingPlan({"": EmbeddingModuleShardingPlan(by_table)})

    ranks = list(range(world))
    every = (
        lambda i: table_wise(rank=i // 4 % world),
        lambda i: row_wise(),
        lambda i: column_wise(ranks=ranks),
        lambda i: table_row_wise(host_index=0),
    )
    from torchrec.distributed.planner.types import ParameterConstraints

    pooling = P.pooling_constraints({t.name: t.pooling_factor for t in tables})
    cpu_only = P.pooling_constraints(
        {t.name: t.pooling_factor for t in tables},
        base={n: ParameterConstraints(sharding_types=list(CPU_TRAINING_SHARDING_TYPES)) for n in names},
    )
    topo = make_topology(f"cpu-{world}")
    batch = _batch_size()
    plans = {
        ROUND_ROBIN: by_hand(lambda i, n: table_wise(rank=i % world)),
        # next to round-robin: the calibration's turns run neighbours seconds apart (the paired check)
        PLANNER: P.plan(ebc, topo, batch_size=batch, constraints=cpu_only, optimizer=OPTIMIZER),
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
    plans["planner, every type"] = P.plan(ebc, topo, batch_size=batch, constraints=pooling, optimizer=OPTIMIZER)
    return plans


def _batch_size() -> int:
    from tpurec.data.catalog import TRAINING_DEFAULTS

    return TRAINING_DEFAULTS[MODEL].batch_size


FIT_PLANS = (ROUND_ROBIN, "row_wise all", "table_wise and row_wise alternating", "four sharding types")


def estimate(plan, costs=None, world: int = WORLD) -> dict:
    """The CPU cost model's step of `plan` (cpu_cost.step_ms on the `cpu-N` report: what it consists of)."""
    from tpurec.data.catalog import get_table_set
    from tpurec.planner import cpu_cost
    from tpurec.planner.report import build_report
    from tpurec.planner.topology import cpu_spec

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


def fit_fixed_terms(parts: dict, measured: dict, costs, names=FIT_PLANS) -> dict:
    """Least-squares step_fixed_ms and group_fixed_ms (>= 0) from the fit plans: measured =
    cpu_cost.combine of the micro-measured embedding work with these two. `combine` takes a max, so
    this is a grid search (coarse, then fine around the best), not a linear solve."""
    from tpurec.planner import cpu_cost

    rows = [
        (parts[n]["embedding_ms_per_rank"], len(parts[n]["groups"]), parts[n]["collective_latency_ms"], measured[n])
        for n in names
    ]

    def error(step_fixed: float, group_fixed: float) -> float:
        c = costs.with_measured(step_fixed_ms=step_fixed, group_fixed_ms=group_fixed)
        return sum((cpu_cost.combine(e, g, lat, c) - y) ** 2 for e, g, lat, y in rows)

    top = max(y for *_, y in rows)
    best = (0.0, 0.0)
    for step, span in ((top / 100, top), (top / 2000, top / 50)):
        f0, g0 = best
        lo_f, lo_g = max(0.0, f0 - span), max(0.0, g0 - span)
        n = int(2 * span / step) + 1
        grid = [(lo_f + i * step, lo_g + k * step) for i in range(n) for k in range(n)]
        best = min(grid, key=lambda fg: error(*fg))
    return {"step_fixed_ms": round(best[0], 3), "group_fixed_ms": round(best[1], 3)}


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


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the k-th smallest and k-th largest of `xs`, k
    the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (so it covers the median with
    probability >= level); the whole range when n is too small for that."""
    from math import comb

    xs = sorted(xs)
    n = len(xs)
    tail, k = 0.0, 0
    while k < n and tail + comb(n, k) / 2**n <= (1 - level) / 2:
        tail += comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def _stats(est: dict, meas: dict, names) -> dict:
    names = list(names)
    e, m = [est[n] for n in names], [meas[n] for n in names]
    return {
        "plans": len(names),
        "spearman": round(spearman(e, m), 3),
        "max_rel_error": round(max(abs(a - b) / b for a, b in zip(e, m)), 4),
    }


# The planner's choice counts as no slower than round-robin if the interval of their paired ratio
# reaches 1 - this (a non-inferiority margin: two equivalent plans differ by noise, never by zero).
NONINFERIORITY_MARGIN = 0.02


def score(plans: dict, turns: list[dict], costs, rounds: int = 3, paired: list[tuple] | None = None) -> dict:
    """Compare the model with measured step times. `turns`: per turn {plan: measured ms per step}
    (the plans' blocks of one turn ran seconds apart). Medians over all turns; `rounds` consecutive
    groups of turns give the per-round rankings. The two fixed terms are fitted on FIT_PLANS (their
    medians); the others are the held-out plans. `paired`: (round-robin ms, planner ms) of the turns
    of a launch of those two plans alone, for the planner's check (default: from `turns`)."""
    medians = {n: _median([t[n] for t in turns]) for n in plans}
    size = -(-len(turns) // min(rounds, len(turns)))
    groups = [turns[i : i + size] for i in range(0, len(turns), size)]
    round_medians = [{n: _median([t[n] for t in g]) for n in plans} for g in groups]
    parts = {n: estimate(p, costs) for n, p in plans.items()}
    fitted = costs.with_measured(**fit_fixed_terms(parts, medians, costs))
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
            "measured_rounds_ms": [round(r[n], 3) for r in round_medians],
            "rel_error": round(abs(est[n] - medians[n]) / medians[n], 4),
        }
        for n in plans
    ]
    every = _stats(est, medians, plans)
    # Paired: round-robin's block over the planner's block of the same turn.
    if paired is None:
        paired = [(t[ROUND_ROBIN], t[PLANNER]) for t in turns]
    ratios = [a / b for a, b in paired]
    low, high = median_interval(ratios)
    return {
        "plans": rows,
        "spearman": every["spearman"],
        "max_rel_error": every["max_rel_error"],
        "held_out": _stats(est, medians, held_out),
        "spearman_per_round": [_stats(est, r, plans)["spearman"] for r in round_medians],
        # the embedding part alone (the planner's objective) against the clock: its ranking
        "spearman_embedding_part": round(
            spearman([parts[n]["embedding_ms"] for n in plans], [medians[n] for n in plans]), 3
        ),
        "costs": {k: getattr(fitted, k) for k in fitted.__dataclass_fields__},
        "planner_s": round(medians[PLANNER] / 1e3, 5),
        "round_robin_tw_s": round(medians[ROUND_ROBIN] / 1e3, 5),
        "planner_vs_round_robin_tw": round(_median(ratios), 4),
        "planner_vs_round_robin_tw_ci95": [round(low, 4), round(high, 4)],
        "planner_vs_round_robin_tw_per_round": [round(r[ROUND_ROBIN] / r[PLANNER], 3) for r in round_medians],
        "paired_turns": len(ratios),
        "paired_round_robin_ms": round(_median([a for a, _ in paired]), 3),
        "paired_planner_ms": round(_median([b for _, b in paired]), 3),
        "noninferiority_margin": NONINFERIORITY_MARGIN,
        # round-robin / planner at least 1 - margin with 95% confidence
        "planner_not_slower": low >= 1 - NONINFERIORITY_MARGIN,
        # the whole interval below 1: the planner's plan slower by more than this host's noise
        "planner_slower_beyond_noise": high < 1,
    }


def _measure(plan_files: list[str], data, turns: int, block: int, warmup: int) -> dict:
    """One 2-rank launch training every plan in turns (tpurec.bench.calibrate_worker)."""
    from tpurec.bench.train import torchrun_json

    args = ["--data", str(data), "--plans", ",".join(plan_files), "--turns", str(turns), "--block", str(block)]
    args += ["--warmup", str(warmup), "--batch-size", str(_batch_size())]
    return torchrun_json("tpurec.bench.calibrate_worker", WORLD, args, "calibration launch")


# Distinct batches per rank the plans cycle through (more only costs data generation).
MAX_BATCHES = 200


def run(
    steps: int = 480,
    warmup: int = 20,
    block: int = 8,
    rounds: int = 3,
    paired_steps: int = 4000,
    only: list[str] | None = None,
) -> dict:
    """Micro-measure the model's terms, train every candidate plan (`only`: those named) in one
    launch, in turns of `block` steps (`steps` timed steps per plan in all), and score. Then the
    planner's choice and round-robin alone, `paired_steps` each in turns: a block of 8 steps here
    moves by +-15% from one block to the next on a 2-core host, so a 2% question needs thousands of
    steps (the interval narrows as 1 / sqrt(steps))."""
    from tpurec.bench import cpu_costs
    from tpurec.dlrm.data import ensure_synth
    from tpurec.planner.cpu_cost import DEFAULT_CPU_COSTS
    from tpurec.planner.plan_io import save_plan

    plans = candidate_plans()
    if only is not None:
        plans = {n: plans[n] for n in only}
    batch = _batch_size()
    turns = max(1, steps // block)
    batches = min(MAX_BATCHES, warmup + turns * (block + 1))
    data = ensure_synth(MODEL, max(10_000, batches * batch * WORLD), 0, say=lambda m: print(m, file=sys.stderr))
    micro = cpu_costs.measure()
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, plan in enumerate(plans.values()):
            paths.append(os.path.join(tmp, f"plan{i}.json"))
            save_plan(plan, paths[-1])
        print(f"training {len(plans)} plans in {turns} turns of {block} steps each", file=sys.stderr)
        out = _measure(paths, data, turns, block, warmup)
        names = list(plans)
        pair = [paths[names.index(ROUND_ROBIN)], paths[names.index(PLANNER)]]
        paired_turns = max(1, paired_steps // block)
        print(f"round-robin and the planner's plan alone: {paired_turns} turns", file=sys.stderr)
        paired_out = _measure(pair, data, paired_turns, block, warmup)
    paired = list(zip(*paired_out["wall_ms"]))
    # How many ranks ran at once, again after the run: the mean of the two goes into the model.
    after = cpu_costs.parallel_terms()
    per_turn = [{n: out["wall_ms"][i][t] for i, n in enumerate(names)} for t in range(turns)]
    cpu = {n: out["cpu_ms"][i] for i, n in enumerate(names)}
    k, c = micro["kernel"], micro["collective"]
    here = DEFAULT_CPU_COSTS.with_measured(
        kernel_fixed_ms=k["kernel_fixed_ms"],
        per_id_us=k["per_id_us"],
        per_id_float_us=k["per_id_float_us"],
        collective_latency_ms=c["collective_latency_ms"],
        gloo_bytes_per_s=c["gloo_bytes_per_s"],
        reduce_scatter_bytes_per_s=c["reduce_scatter_bytes_per_s"],
        all_gather_bytes_per_s=c["all_gather_bytes_per_s"],
        host_cores=(micro["parallel"]["parallel_ranks"] + after["parallel_ranks"]) / 2,
    )
    scored = score(plans, per_turn, here, rounds, paired)
    result = {
        "model": MODEL,
        "nproc": WORLD,
        "batch_size_per_rank": batch,
        "steps": turns * block,
        "block": block,
        "turns": turns,
        "paired_steps": paired_turns * block,
        "warmup": warmup,
        "threads_per_rank": 1,
        "micro": {**micro, "parallel_after": after},
        # the model with this run's micro-measured terms
        **scored,
        # the same with the stored constants the planner plans with (cpu_cost.DEFAULT_CPU_COSTS)
        "with_stored_constants": {
            k: v for k, v in score(plans, per_turn, DEFAULT_CPU_COSTS, rounds, paired).items() if k not in ("plans",)
        },
        "measured_cpu_ms": {n: round(_median(v), 3) for n, v in cpu.items()},
        # the model's ranking against the CPU-seconds per step (the work; less disturbed by other jobs)
        "spearman_vs_cpu_time": round(
            spearman([p["estimated_ms"] for p in scored["plans"]], [_median(cpu[p["plan"]]) for p in scored["plans"]]),
            3,
        ),
        "measured_turns_ms": {n: [round(t[n], 3) for t in per_turn] for n in names},
        "load_average_1min": [load_start, round(os.getloadavg()[0], 2)],
    }
    return result
