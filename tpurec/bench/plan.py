"""`tpurec bench plan`: planning time of tpurec's planner against TorchRec's own, side by side.

Both plan the same model (a catalog table set on the meta device, with its pooling factors) for the
same world size and batch, in turns (`timer.interleaved`), so load from other processes falls on
both alike: tpurec's `planner.plan` on the TPU slice, and TorchRec's `EmbeddingShardingPlanner`
with its defaults (estimators, proposers, `EmbeddingBagCollectionSharder`) on a cuda `Topology` of
the same world size in hosts of 8 GPUs (TorchRec's defaults otherwise), i.e. what a TorchRec user
plans with today.
Median wall seconds of the timed runs; `ratio_vs_torchrec` = torchrec_s / tpurec_s (above 1:
tpurec plans faster). Imports and the first (warm-up) round are not timed.
"""

from __future__ import annotations

import argparse

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.data.catalog import MODEL_NAMES, TRAINING_DEFAULTS

GPUS_PER_HOST = 8  # an 8-GPU host, as the MLPerf DLRM-DCNv2 reference's 8xH200 (DESIGN.md, "Anchors")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="planning time: tpurec's planner vs TorchRec's (cuda topology), same model")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.add_argument("--model", choices=MODEL_NAMES, default="mlperf-dcnv2", help="model to plan (default mlperf-dcnv2)")
    p.add_argument(
        "--topology", default="v5p-128", help="TPU slice for tpurec; TorchRec gets its world size (default v5p-128)"
    )
    p.add_argument("--batch-size", type=positive_int, default=None, help="per device (default: the model's)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (default 3)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="instead: the CPU cost model's step time vs measured, 12 dlrm-tiny plans at 2 CPU ranks "
        "(spearman, max_rel_error, planner vs round-robin table-wise)",
    )
    p.add_argument("--steps", type=positive_int, default=480, help="--calibrate: timed steps per plan (default 480)")
    p.add_argument(
        "--block",
        type=positive_int,
        default=8,
        help="--calibrate: steps per plan per turn; the plans take turns in one launch (default 8)",
    )
    p.add_argument(
        "--paired-steps",
        type=positive_int,
        default=4000,
        help="--calibrate: steps of the planner's plan and round-robin alone, in turns (default 4000)",
    )
    p.add_argument("--warmup", type=positive_int, default=20, help="--calibrate: untimed steps first (default 20)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="--calibrate: groups of consecutive turns for the per-round rankings (default 3)",
    )
    p.set_defaults(run=main)


def _contestants(model: str, topology: str, batch_size: int, optimizer: str):
    import logging

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology

    from tpurec.data.catalog import get_table_set
    from tpurec.planner import planners as P
    from tpurec.planner.report import tables_module
    from tpurec.planner.topology import make_topology

    # torchrec warns that a Topology was not made by its factory; not actionable in a benchmark
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    tables = list(get_table_set(model).tables)
    ebc = tables_module(tables)
    constraints = P.pooling_constraints({t.name: t.pooling_factor for t in tables})
    tpu = make_topology(topology)
    # TorchRec's defaults, except hosts of 8 GPUs (its default puts the whole world on one host)
    cuda = Topology(
        world_size=tpu.world_size, compute_device="cuda", local_world_size=min(GPUS_PER_HOST, tpu.world_size)
    )

    def ours():
        return P.plan(ebc, tpu, batch_size=batch_size, constraints=constraints, optimizer=optimizer)

    def theirs():
        planner = EmbeddingShardingPlanner(topology=cuda, batch_size=batch_size, constraints=constraints, debug=False)
        return planner.plan(ebc, [EmbeddingBagCollectionSharder()])

    return tpu, cuda, [ours, theirs]


def _summary(plan) -> dict:
    shardings = [ps for module_plan in plan.plan.values() for ps in module_plan.values()]
    return {
        "tables": len(shardings),
        "compute_kernels": sorted({ps.compute_kernel for ps in shardings}),
        "sharding_types": sorted({ps.sharding_type for ps in shardings}),
    }


def run(model: str = "mlperf-dcnv2", topology: str = "v5p-128", batch_size: int | None = None, repeats: int = 3):
    from tpurec.bench.timer import interleaved

    defaults = TRAINING_DEFAULTS[model]
    batch_size = batch_size or defaults.batch_size
    tpu, cuda, fns = _contestants(model, topology, batch_size, defaults.embedding_optimizer)
    ours, theirs = interleaved(fns, warmup=1, repeats=repeats)
    return {
        "model": model,
        "topology": topology,
        "world_size": tpu.world_size,
        "torchrec_topology": f"cuda x {cuda.world_size} ({cuda.local_world_size} per host)",
        "batch_size_per_device": batch_size,
        "optimizer": defaults.embedding_optimizer,
        "repeats": repeats,
        "tpurec_s": round(ours.median, 3),
        "torchrec_s": round(theirs.median, 3),
        "ratio_vs_torchrec": round(theirs.median / ours.median, 3),
        "tpurec_runs_s": [round(x, 3) for x in ours.wall],
        "torchrec_runs_s": [round(x, 3) for x in theirs.wall],
        "tpurec_cpu_s": round(sorted(ours.cpu)[len(ours.cpu) // 2], 3),
        "torchrec_cpu_s": round(sorted(theirs.cpu)[len(theirs.cpu) // 2], 3),
        "tpurec_plan": _summary(ours.results[-1]),
        "torchrec_plan": _summary(theirs.results[-1]),
    }


def main(args: argparse.Namespace) -> int:
    if args.calibrate:
        from tpurec.bench import calibrate

        result = calibrate.run(
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            rounds=args.rounds,
            paired_steps=args.paired_steps,
        )
        if args.json:
            print(strict_json.dumps(result, indent=2))
        else:
            for r in result["plans"]:
                fit = " (fit)" if r["fit"] else ""
                print(
                    f"{r['plan'] + fit:<46} estimated {r['estimated_ms']:8.2f} ms  measured {r['measured_ms']:8.2f} ms"
                )
            h = result["held_out"]
            print(
                f"spearman {result['spearman']:.3f} (held-out {h['spearman']:.3f}), max_rel_error "
                f"{result['max_rel_error']:.3f} (held-out {h['max_rel_error']:.3f}); "
                f"planner {result['planner_s'] * 1e3:.2f} ms vs "
                f"round-robin table-wise {result['round_robin_tw_s'] * 1e3:.2f} ms; paired ratio "
                f"{result['planner_vs_round_robin_tw']:.3f} (95% interval "
                f"{result['planner_vs_round_robin_tw_ci95'][0]:.3f}-{result['planner_vs_round_robin_tw_ci95'][1]:.3f}, "
                f"{result['paired_turns']} turns)"
            )
        return 0
    result = run(args.model, args.topology, args.batch_size, args.repeats)  # UserError: a bad slice, a misfit
    if args.json:
        print(strict_json.dumps(result, indent=2))
        return 0
    r = result
    print(
        f"planning {r['model']} at batch {r['batch_size_per_device']}/device, {r['repeats']} rounds (median):\n"
        f"  tpurec   {r['topology']:>12}  {r['tpurec_s']:.2f} s\n"
        f"  torchrec {'cuda x ' + str(r['world_size']):>12}  {r['torchrec_s']:.2f} s\n"
        f"  torchrec / tpurec = {r['ratio_vs_torchrec']:.2f}"
    )
    return 0
