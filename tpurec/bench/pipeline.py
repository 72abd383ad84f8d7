"""`tpurec bench pipeline`: Parquet -> KJT -> SparseCore CSR, the host work that has to feed a step.

Workload: the MLPerf DLRM-DCNv2 multi-hot shape (26 features, ids per sample 3,2,1,2,6,1,1,1,1,7,3,
8,1,6,9,5,1,1,1,12,100,27,10,3,1,1 = 214, the `mlperf-dcnv2` tables, 204M rows, dim 128), synthetic
rows from `tpurec.data.synth` (Zipf 1.1 ids scattered over each table), uncompressed Parquet, batch
2048 per step, S = 4 SparseCores, one device. Id limits are the largest observed over the batches
(8-aligned) for both sides, fixed as on a TPU, so nothing drops.

One run = one full pass over the batches, each side on the same files and batches:
* tpurec: `ParquetReader` -> KJT -> `SparseCoreKernel.preprocess` (the model's one stack of 26
  tables, on a preprocessing-only kernel on "meta"); on 1 core inline, on c cores through
  `tpurec.data.prefetch.Prefetcher` (reader decode thread, c CSR workers);
* jte: pyarrow decode of the same row groups (`read_row_group`, list columns -> [B, k] int32) +
  jax-tpu-embedding 0.1.0's C++ `preprocess_sparse_dense_matmul_input` on 26 tables (its own MOD
  layout per table), its thread pool sized to the cores (SPARSECORE_INPUT_PREPROCESSING_THREADS).

Each core count runs in its own child process pinned to that many CPUs (`sched_setaffinity`), since
jte reads its thread count once per process. Equal work is checked once per child: both sides'
input streams must hold the same batches of the same ids (count and sum per batch), else the child
fails. The sides take turns run by run in a fresh random order each round (`timer.interleaved`);
the ratio is the median over rounds of jte seconds / tpurec seconds, with the worst and best round
and the load average (throughputs: median runs). Also measured in the 1-core child,
to say what bounds the pipeline: the reader alone (Parquet decode + KJT), the CSR build alone on
batches already read, and the machine's copy bandwidth (numpy copy of 256 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench import rounds, timer
from tpurec.runtime import safe_path

NUM_SC = 4
GOAL_IDS_PER_S_PER_CORE = 29e6  # v6e-8: ~650 M ids/s per chip, 180 vCPUs for 8 chips


def _copy_gb_per_s(mb: int = 256, repeats: int = 5) -> float:
    src = np.ones(mb << 20, np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best / 1e9  # read + write


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _kernel(table_set, pooling=None):
    """A preprocessing-only kernel of the table set; `pooling` (ids per sample per table) places the
    stack's tables as `tpurec train` has them placed (its DMP gets the pooling factors)."""
    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec

    pooling = pooling or [None] * len(table_set.tables)
    tables = [KernelTable(t.name, t.num_embeddings, t.embedding_dim, (t.feature,), expected_ids=p)
              for t, p in zip(table_set.tables, pooling)]  # fmt: skip
    return tables, lambda **kw: SparseCoreKernel(tables, SGDSpec(lr=0.1), NUM_SC, device="meta", **kw)


def _jte_batches(data_dir, names, sizes, batch_size):
    """pyarrow decode of every row group, cut into [B, k] int32 arrays per feature (jte's input)."""
    import pyarrow.parquet as pq

    from tpurec.data.schema import list_parquet_files

    carry = None
    for path in list_parquet_files(data_dir):
        pf = pq.ParquetFile(path, memory_map=True)
        for rg in range(pf.num_row_groups):
            t = pf.read_row_group(rg, columns=names, use_threads=False)
            cols = []
            for name, k in zip(names, sizes):
                col = t.column(name).combine_chunks()
                flat = col.values.to_numpy() if k > 1 else col.to_numpy()
                cols.append(flat.astype(np.int32).reshape(-1, k))
            if carry is not None:
                cols = [np.concatenate([a, b]) for a, b in zip(carry, cols)]
            n = len(cols[0]) // batch_size * batch_size
            for s in range(0, n, batch_size):
                yield [c[s : s + batch_size] for c in cols]
            carry = [c[n:] for c in cols] if n < len(cols[0]) else None


def _fixed_limits(table_set, sizes: list[int], batches: list, batch_size: int):
    """Id limits from the data for both sides (untimed): the stack's, and each table's under jte's
    MOD layout (8-aligned). Returns (the tpurec kernel with the stack's limits fixed, the stack's
    max ids per partition, [[max ids, max unique ids] per table] for jte)."""
    import torch

    from tpurec.embedding.constraints import round_up
    from tpurec.embedding.preprocess import preprocess

    names = [t.feature for t in table_set.tables]
    _, make = _kernel(table_set, [float(k) for k in sizes])
    sizing = make(fixed_limits=False)
    stack_ids = stack_uniq = 0
    jte_lim = [[8, 8] for _ in names]
    for b in batches:
        sizing.preprocess(b.sparse_features)
        st = next(iter(sizing.last_stats.values()))
        stack_ids, stack_uniq = (
            max(stack_ids, st.max_ids_per_partition),
            max(stack_uniq, st.max_unique_ids_per_partition),
        )
        kjt = b.sparse_features.to_dict()
        for j, name in enumerate(names):
            ids = kjt[name].values()
            smp = torch.arange(batch_size).repeat_interleave(kjt[name].lengths().long())
            _, s = preprocess(ids, smp, torch.ones(ids.numel()), device_batch_size=batch_size, num_sc_per_device=NUM_SC)
            jte_lim[j][0] = max(jte_lim[j][0], round_up(s.max_ids_per_partition, 8))
            jte_lim[j][1] = max(jte_lim[j][1], round_up(s.max_unique_ids_per_partition, 8))
    kernel = make(fixed_limits=True, max_ids_per_partition=stack_ids, max_unique_ids_per_partition=stack_uniq)
    return kernel, stack_ids, jte_lim


def _jte_side(data_dir, table_set, sizes: list[int], jte_lim: list[list[int]], batch_size: int):
    """jte's run: pyarrow decode + its C++ preprocessing of every batch, with the limits `jte_lim`."""
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    from tpurec.bench.preprocess import jte_feature_specs

    names = [t.feature for t in table_set.tables]
    specs = jte_feature_specs(
        [
            (names[j], t.name, t.num_embeddings, t.embedding_dim, k, tuple(jte_lim[j]))
            for j, (t, k) in enumerate(zip(table_set.tables, sizes))
        ],
        batch_size,
        NUM_SC,
    )
    weights = [np.ones((batch_size, k), np.float32) for k in sizes]

    def theirs() -> None:
        for feats in _jte_batches(data_dir, names, sizes, batch_size):
            embedding.preprocess_sparse_dense_matmul_input(feats, weights, specs, 1, 1, num_sc_per_device=NUM_SC)

    return theirs


def _check_equal_work(batches: list, data_dir, names: list[str], sizes: list[int], batch_size: int) -> None:
    """Equal work, checked once: both sides' input streams hold the same batches of the same ids."""
    ours_in = [(int(b.sparse_features.values().numel()), int(b.sparse_features.values().sum())) for b in batches]
    theirs_in = [
        (sum(f.size for f in feats), sum(int(f.sum(dtype=np.int64)) for f in feats))
        for feats in _jte_batches(data_dir, names, sizes, batch_size)
    ]
    if ours_in != theirs_in:
        raise RuntimeError(f"unequal work: tpurec reads {len(ours_in)} batches, jte {len(theirs_in)}, or other ids")


def _bounds(kernel, batches: list, reader, repeats: int, ids_per_batch: int, csr_slots_per_step: int) -> dict:
    """What bounds the pipeline: its two stages alone, and the machine's memory bandwidth.
    CPU seconds (the child's only thread works): steadier than wall time on a shared host."""
    steps = len(batches)

    def csr_only() -> None:
        for b in batches:  # results dropped at once, as a consumed step's are
            kernel.preprocess(b.sparse_features)

    t_read = min(timer.repeat(lambda: sum(1 for _ in reader(0)), warmup=0, repeats=repeats).cpu) / steps
    t_csr = min(timer.repeat(csr_only, warmup=0, repeats=repeats).cpu) / steps
    return dict(
        read_kjt_cpu_ms=round(1e3 * t_read, 2),
        csr_build_cpu_ms=round(1e3 * t_csr, 2),
        read_kjt_ids_per_cpu_s=round(ids_per_batch / t_read),
        csr_build_ids_per_cpu_s=round(ids_per_batch / t_csr),
        copy_gb_per_s=round(_copy_gb_per_s(), 2),
        # bytes a step must at least write: the CSR buffers (3 x 4 bytes per slot) and the KJT
        csr_bytes_per_step=csr_slots_per_step * 12,
    )


def child(spec: dict) -> dict:
    """One core count: runs in its own process, pinned to `cores` CPUs. Steps: read the batches and
    fix both sides' id limits from them (untimed, `_fixed_limits`), check both sides do the same
    work, time them in turns, and (with `bounds`) what bounds the pipeline."""
    cores, data_dir, batch_size = spec["cores"], spec["data"], spec["batch_size"]
    os.environ["SPARSECORE_INPUT_PREPROCESSING_THREADS"] = str(cores)
    import torch

    torch.set_num_threads(1)
    from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT, get_table_set
    from tpurec.data.prefetch import Prefetcher
    from tpurec.data.reader import ParquetReader
    from tpurec.embedding import csr_build
    from tpurec.embedding.constraints import coo_entries_per_sc

    table_set = get_table_set("mlperf-dcnv2")
    sizes = list(MLPERF_DCNV2_MULTI_HOT)
    names = [t.feature for t in table_set.tables]

    def reader(prefetch):
        return ParquetReader(data_dir, batch_size, prefetch=prefetch, drop_last=True)

    batches = list(reader(0))
    kernel, stack_ids, jte_lim = _fixed_limits(table_set, sizes, batches, batch_size)
    ids_per_batch = int(batches[0].sparse_features.values().numel())
    steps = len(batches)

    def ours() -> None:
        if cores == 1:
            for b in reader(0):
                kernel.preprocess(b.sparse_features)
        else:
            pf = Prefetcher(reader(2), lambda b: kernel.preprocess(b.sparse_features), depth=2 * cores,
                            workers=cores, epochs=1)  # fmt: skip
            for _ in pf:
                pass

    theirs = _jte_side(data_dir, table_set, sizes, jte_lim, batch_size)
    from tpurec.bench.preprocess import _Quiet

    _check_equal_work(batches, data_dir, names, sizes, batch_size)
    warmup, repeats = spec["warmup"], spec["repeats"]
    orders: list = []
    load_before = rounds.load_average()[0]
    with _Quiet():
        r_ours, r_jte = timer.interleaved(
            [ours, theirs], warmup=warmup, repeats=repeats, orders=orders, seed=spec.get("order_seed", 0)
        )
    summary = rounds.ratio_summary(r_ours.wall, r_jte.wall)
    t_ours, t_jte = r_ours.median / steps, r_jte.median / steps
    out = {
        "cores": cores,
        "steps": steps,
        "ids_per_step": ids_per_batch,
        "samples_per_s": round(batch_size / t_ours),
        "ids_per_s": round(ids_per_batch / t_ours),
        "ids_per_s_per_core": round(ids_per_batch / t_ours / cores),
        "step_ms": round(1e3 * t_ours, 2),
        "jte_samples_per_s": round(batch_size / t_jte),
        "jte_ids_per_s_per_core": round(ids_per_batch / t_jte / cores),
        "jte_step_ms": round(1e3 * t_jte, 2),
        "ratio_vs_jte": round(summary["ratio"], 3),  # median over rounds of jte seconds / tpurec seconds
        "min": round(summary["min"], 3),
        "max": round(summary["max"], 3),
        "round_ratios": summary["round_ratios"],
        "first_in_round": [("tpurec", "jte")[o[0]] for o in orders],
        "load_average_1min": [load_before, rounds.load_average()[0]],
        "cpu_seconds_per_step": round(statistics.median(r_ours.cpu) / steps, 4),
        "jte_cpu_seconds_per_step": round(statistics.median(r_jte.cpu) / steps, 4),
        # per CPU-second: steadier than wall time on a shared host (other jobs take cores, not CPU time)
        "ratio_vs_jte_cpu": round(rounds.ratio_summary(r_ours.cpu, r_jte.cpu)["ratio"], 3),
        "ids_per_cpu_s": round(ids_per_batch * steps / statistics.median(r_ours.cpu)),
        "compiled_csr_build": csr_build.available(),
        "stack_max_ids_per_partition": int(stack_ids),
        "csr_slots_per_step": int(kernel.preprocess(batches[0].sparse_features)[0].embedding_ids.numel()),
        "jte_csr_slots_per_step": int(sum(NUM_SC * coo_entries_per_sc(mi, NUM_SC) for mi, _ in jte_lim)),
    }
    if spec.get("bounds"):
        out.update(_bounds(kernel, batches, reader, repeats, ids_per_batch, out["csr_slots_per_step"]))
    return out


def run_bench(
    *,
    batch_size: int = 2048,
    steps: int = 24,
    cores=None,
    repeats: int = 3,
    warmup: int = 1,
    data_dir=None,
    quick: bool = False,
) -> dict:
    """Generate the data, run each core count in a pinned child, and gather the figures."""
    from tpurec.data.synth import synthesize

    order_seed = rounds.fresh_seed()
    load_start = rounds.load_average()
    all_cores = len(os.sched_getaffinity(0))
    counts = sorted({1, all_cores}) if cores is None else sorted(set(cores))
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tpurec-bench-pipeline-")
        data_dir = tmp.name
    try:
        if not any(n.endswith(".parquet") for n in os.listdir(data_dir)):
            synthesize(batch_size * steps, data_dir, seed=0, table_set="mlperf-dcnv2", row_group_size=8 * batch_size,
                       show_progress=False, overwrite=True)  # fmt: skip
        per = {}
        for c in counts:
            spec = {"cores": c, "data": str(data_dir), "batch_size": batch_size, "repeats": repeats, "warmup": warmup,
                    "bounds": c == 1, "order_seed": order_seed + c}  # fmt: skip
            per[f"cores_{c}"] = _spawn(spec, list(sorted(os.sched_getaffinity(0)))[:c])
    finally:
        if tmp is not None:
            tmp.cleanup()
    one, top = per[f"cores_{counts[0]}"], per[f"cores_{counts[-1]}"]
    return {
        "workload": f"mlperf-dcnv2 multi-hot (214 ids/sample), batch {batch_size}, {NUM_SC} SparseCores, 1 device",
        "batch_size": batch_size,
        "ids_per_s_per_core": one["ids_per_s_per_core"],
        "samples_per_s": top["samples_per_s"],
        "ratio_vs_jte": min(p["ratio_vs_jte"] for p in per.values()),  # the worst core count's median
        "worst_round_ratio_vs_jte": min(p["min"] for p in per.values()),
        "order_seed": order_seed,
        "goal_ids_per_s_per_core": GOAL_IDS_PER_S_PER_CORE,
        "fraction_of_goal": round(one["ids_per_s_per_core"] / GOAL_IDS_PER_S_PER_CORE, 3),
        "load_average": {"start": load_start, "end": rounds.load_average()},
        **per,
    }


def _spawn(spec: dict, cpus: list[int]) -> dict:
    env = safe_path.env(TPUREC_BENCH_CPUS=",".join(map(str, cpus)))  # no code from the working directory
    proc = subprocess.run(
        safe_path.python("-m", "tpurec.bench.pipeline", strict_json.dumps(spec)),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"bench pipeline child ({spec['cores']} cores) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="Parquet -> KJT -> SparseCore CSR per step vs pyarrow + jax-tpu-embedding")
    p.add_argument("--batch-size", type=positive_int, default=2048, help="samples per step (default 2048)")
    p.add_argument("--steps", type=positive_int, default=24, help="batches in the generated data (default 24)")
    p.add_argument("--cores", help="core counts, e.g. 1,2 (default 1 and all)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3; the median ratio counts)")
    p.add_argument("--quick", action="store_true", help="batch 256, 8 steps, 1 timed pass")
    p.add_argument("--dir", help="data directory (generated when empty, kept)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    kw = dict(batch_size=args.batch_size, steps=args.steps, repeats=args.repeats)
    if args.quick:
        kw.update(batch_size=256, steps=8, repeats=1, warmup=0)
    cores = [int(x) for x in args.cores.split(",")] if args.cores else None
    if args.dir:
        from tpurec.outputs import output_problem

        problem = output_problem("--dir", args.dir, "dir")
        if problem:
            print(f"tpurec bench pipeline: error: {problem}", file=sys.stderr)
            return 2
        os.makedirs(args.dir, exist_ok=True)
    res = run_bench(cores=cores, data_dir=args.dir, **kw)
    if args.json:
        print(strict_json.dumps(res, indent=2))
        return 0
    print(res["workload"])
    for key, p in res.items():
        if key.startswith("cores_"):
            print(
                f"{p['cores']} core(s): {p['ids_per_s_per_core'] / 1e6:.1f} M ids/s per core, "
                f"{p['samples_per_s']:,} samples/s; jte {p['jte_samples_per_s']:,} samples/s; "
                f"ratio {p['ratio_vs_jte']} [{p['min']}, {p['max']}]"
            )
    la = res["load_average"]
    print(
        f"median of {kw['repeats']} rounds in random order; "
        f"load average {la['start'][0]} at start, {la['end'][0]} at end"
    )
    print(f"goal {GOAL_IDS_PER_S_PER_CORE / 1e6:.0f} M ids/s per core: {res['fraction_of_goal']:.0%} of it")
    return 0


if __name__ == "__main__":
    cpus = os.environ.get("TPUREC_BENCH_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    print(strict_json.dumps(child(json.loads(sys.argv[1]))))
