"""What a training step costs on CPU ranks over gloo: the terms of the `cpu-N` cost model.

On a TPU the embedding work is bandwidth-bound and the model counts bytes (estimators.shard_cost).
On CPU (the reference kernel, one thread per rank, gloo between processes on one host) the step is
made of other things, each measured here on this 2-core host (`python -m tpurec.bench.cpu_costs`,
which `tpurec bench plan --calibrate` runs and records too; docs/planner.md, "The CPU cost model"):

* per id looked up and updated: `per_id_us + per_id_float_us * dim` (the reference gathers, scatters
  and updates one row per id: a cost per id plus one per float of the row), on the rank that holds
  the shard;
* per kernel call (one per sharding group a rank holds shards of, forward + fused backward):
  `kernel_fixed_ms`, whatever its size (preprocessing, op dispatch, autograd);
* per byte sent: `gloo_bytes_per_s` for all-to-all, `reduce_scatter_bytes_per_s` and
  `all_gather_bytes_per_s` for row-wise sharding's pooled output and its gradient (gloo runs
  those two 3-4x slower per byte); per collective: `collective_latency_ms`. Every sharding group
  runs `COLLECTIVES_PER_GROUP` collectives a step, and the pipeline one more for all groups;
* per sharding group: `group_fixed_ms` of TorchRec's Python around those collectives, and per step
  `step_fixed_ms` (dense MLPs, their optimiser and all-reduce, the pipeline): these two are not
  micro-measured but fitted by the calibration on a subset of its plans (reported apart).

Ranks run at once only if the host has a core for each: a step is the busiest rank's work (its
embedding part plus the per-step and per-group work every rank does), or the ranks' total over
`host_cores` (the cores free for them), whichever is longer (`combine`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

# TorchRec's pooled-embedding sharding groups: lengths and values all-to-all in (input dist), the
# pooled rows out (all-to-all, or reduce-scatter for row-wise) and their gradient back.
COLLECTIVES_PER_GROUP = 4
# The per-group input splits, which TrainPipelineSparseDist fuses into one all-to-all for all groups.
SHARED_COLLECTIVES = 1


@dataclass(frozen=True)
class CpuCosts:
    # Measured on a 2-core CPU host by `python -m tpurec.bench.cpu_costs` (the runs, their load and
    # the raw timings: docs/results.md, "CPU cost model terms"). SparseCoreKernel fwd + row-wise
    # Adagrad bwd, 1 thread (cpu_costs.kernel_terms): fixed, per id, per id and float of dim.
    kernel_fixed_ms: float = 1.35
    per_id_us: float = 0.208
    per_id_float_us: float = 0.0065
    # gloo all_to_all_single between 2 processes: 64 B (latency) and 1 MiB per rank (bandwidth).
    collective_latency_ms: float = 0.18
    gloo_bytes_per_s: float = 1.28e9
    # reduce_scatter_single and all_gather_single of 1 MiB per rank: bytes leaving a rank per second
    # beyond the latency (gloo runs them slower per byte than its all-to-all).
    reduce_scatter_bytes_per_s: float = 0.37e9
    all_gather_bytes_per_s: float = 0.70e9
    # Not per shard, so the planner never reads them; the calibration fits them afresh each run (on
    # its FIT_PLANS). Round placeholders.
    group_fixed_ms: float = 2.0
    step_fixed_ms: float = 20.0
    # Ranks that run at once: 0 means the host's cores (os.sched_getaffinity), right on an idle host;
    # the calibration measures it (cpu_costs.parallel_terms), since other jobs share the cores.
    host_cores: float = 0

    @property
    def cores(self) -> float:
        if self.host_cores:
            return self.host_cores
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1

    def with_measured(self, **terms: float) -> CpuCosts:
        """These costs with some terms replaced (a fresh micro-measurement, a fit)."""
        return replace(self, **{k: v for k, v in terms.items() if v is not None})


DEFAULT_CPU_COSTS = CpuCosts()


def compute_ms(ids: float, dim: int, costs: CpuCosts) -> float:
    """Reference-kernel time of `ids` lookups + fused updates of rows `dim` wide."""
    return ids * (costs.per_id_us + costs.per_id_float_us * dim) * 1e-3


def transfer_ms(nbytes: float, group: int, costs: CpuCosts, collective: str = "all_to_all") -> float:
    """A rank's share of a gloo `collective` over a buffer of `nbytes` in a group of `group`: the
    (group-1)/group of it that leaves the rank, at that collective's bytes per second (latency is
    counted per group, in step_ms)."""
    if group <= 1 or nbytes == 0:
        return 0.0
    bandwidth = {
        "all_to_all": costs.gloo_bytes_per_s,
        "reduce_scatter": costs.reduce_scatter_bytes_per_s,
        "all_gather": costs.all_gather_bytes_per_s,
    }[collective]
    return nbytes * (group - 1) / group / bandwidth * 1e3


def combine(embedding_ms: list[float], groups: int, latency_ms: float, costs: CpuCosts) -> float:
    """A step from each rank's embedding work: every rank also does the per-step and per-group
    work (`step_fixed_ms`, `groups * group_fixed_ms`: dense MLPs, TorchRec's Python), and all of it
    shares the host's cores, so the step is the busiest rank's work or the ranks' total over
    `cores`, whichever is longer, plus the collectives' latency. (With the fixed work outside that
    bound, one rank carrying every table was charged its whole extra embedding time, +4 ms; measured
    on 2 ranks it cost 0.6-1.3 ms: the other rank's dense work fills most of the gap.)"""
    busy = [costs.step_fixed_ms + groups * costs.group_fixed_ms + e for e in embedding_ms]
    return max(max(busy), sum(busy) / costs.cores) + latency_ms


def step_ms(report: dict, costs: CpuCosts) -> dict:
    """A whole training step of a plan from its `build_report` document on a `cpu-N` topology.

    The report's per-device times are the per-shard terms (compute, bytes); this adds the per-kernel,
    per-group and per-step terms (`combine`). Returns the parts and their sum `step_ms`.
    """
    world = report["world_size"]
    groups = sorted({t["sharding_type"] for t in report["tables"]})
    kernels = [0] * world  # kernel calls per rank: one per sharding group it holds shards of
    for st in groups:
        for r in {s["rank"] for t in report["tables"] if t["sharding_type"] == st for s in t["shards"]}:
            kernels[r] += 1
    embedding = [d["estimated_time_ms"] + k * costs.kernel_fixed_ms for d, k in zip(report["devices"], kernels)]
    collectives = len(groups) * COLLECTIVES_PER_GROUP + SHARED_COLLECTIVES if world > 1 else 0
    latency = collectives * costs.collective_latency_ms
    return {
        "step_ms": combine(embedding, len(groups), latency, costs),
        "groups": groups,
        "kernels_per_rank": kernels,
        "embedding_ms_per_rank": embedding,
        "busiest_rank_ms": max(embedding),
        "collective_latency_ms": latency,
        "group_fixed_ms": len(groups) * costs.group_fixed_ms,
        "step_fixed_ms": costs.step_fixed_ms,
    }
