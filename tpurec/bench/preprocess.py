"""`tpurec bench preprocess`: tpurec's SparseCore input preprocessing vs jax-tpu-embedding's C++ one.

Workload (defaults): 26 features, one table each of 100k rows, device batch 2048, every bag exactly
`pooling` ids (1 and 20), ids Zipf(1.05) folded into the vocabulary ((z - 1) mod 100k, hot ids at the
first rows: `tpurec.bench.workloads.zipf_ids` without scattering), weights 1,
num_sc_per_device=4, one device (P = 4). Limits are taken from the data (per table: the largest
observed ids / unique ids per partition, rounded up to 8), so nothing drops and both sides build
the same buffers; the first table's outputs are compared once (`outputs_match`).

One step = the 26 tables preprocessed:
* tpurec: one `preprocess_tables` call on 26 prebuilt (ids, sample_index, gains) torch tensors with
  num_threads=`threads` (torch is also pinned with torch.set_num_threads(`threads`));
  `tpurec_loop_samples_per_s` is the same work as 26 single-table `preprocess` calls in turn;
* jax-tpu-embedding 0.1.0: one `embedding.preprocess_sparse_dense_matmul_input` call with 26
  2-D [batch, pooling] int32 id arrays and float32 weight arrays (its fastest input form), its C++
  thread pool sized by the env var SPARSECORE_INPUT_PREPROCESSING_THREADS=`threads`. The pool is
  created on the process's first C++ preprocessing call, so the variable only takes effect in a
  process that has not preprocessed yet (a fresh `tpurec bench preprocess` always is).

Equal work is checked once per pooling factor before timing: the first table's CSR (row
pointers, ids and sample ids up to each SparseCore's end) must be the same on both sides, else the
pooling factor is refused (`UnequalWork`, exit 1). Then both get `warmup` untimed steps and
`repeats` timed rounds, each round every contestant one step, in a fresh random order
(`tpurec.bench.timer.interleaved`, so load from other processes hits both alike). Per pooling
factor: the median over rounds of jte seconds / tpurec seconds (`ratio_vs_jte`) with the worst and
best round (`min`, `max`); samples/s = batch / median step time. The C++ path logs a buffer-usage
warning per table per call to stderr; fd 2 is sent to /dev/null while it runs. Top-level figures
are those of the pooling factor with the worse median ratio (named in `worst_pooling`), the worst
single round and the load average; per-pooling figures are under pooling_<pf>.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import numpy as np

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench import rounds, timer, workloads
from tpurec.bench.equal_work import UnequalWork

NUM_SC = 4


class _Quiet:
    """Send fd 2 (C++ logging) to /dev/null for the duration."""

    def __enter__(self) -> None:
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc) -> None:
        os.dup2(self.saved, 2)
        os.close(self.saved)


def _bench_pooling(pooling, *, batch_size, num_features, vocab, zipf_a, seed, warmup, repeats, threads, order_seed=0):
    import torch

    from tpurec.embedding.constraints import round_up
    from tpurec.embedding.preprocess import preprocess, preprocess_tables

    rng = np.random.default_rng(seed + pooling)
    ids2d = workloads.fixed_pooling_ids(rng, num_features, batch_size, pooling, vocab, zipf_a)
    sample = torch.arange(batch_size).repeat_interleave(pooling)
    gains = torch.ones(batch_size * pooling, dtype=torch.float32)
    ours_in = [(torch.from_numpy(x.reshape(-1)), sample, gains) for x in ids2d]

    # Limits from the data: nothing drops, and the C++ path sees the same limits.
    limits = []
    for ids, smp, g in ours_in:
        _, st = preprocess(ids, smp, g, device_batch_size=batch_size, num_sc_per_device=NUM_SC)
        limits.append((round_up(st.max_ids_per_partition, 8), round_up(st.max_unique_ids_per_partition, 8)))

    def tpurec_step():
        return preprocess_tables(
            ours_in,
            device_batch_size=batch_size,
            num_sc_per_device=NUM_SC,
            max_ids_per_partition=[mi for mi, _ in limits],
            max_unique_ids_per_partition=[mu for _, mu in limits],
            table_names=[f"t{i}" for i in range(num_features)],
            num_threads=threads,
        )

    def tpurec_loop_step():  # one `preprocess` call per table, in turn
        return [
            preprocess(
                ids,
                smp,
                g,
                device_batch_size=batch_size,
                num_sc_per_device=NUM_SC,
                max_ids_per_partition=mi,
                max_unique_ids_per_partition=mu,
                table_name=f"t{i}",
            )
            for i, ((ids, smp, g), (mi, mu)) in enumerate(zip(ours_in, limits))
        ]

    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    specs = jte_feature_specs([(f"f{i}", f"t{i}", vocab, 8, pooling, lim) for i, lim in enumerate(limits)], batch_size)
    jte_feats = [x.astype(np.int32) for x in ids2d]
    jte_weights = [np.ones((batch_size, pooling), np.float32) for _ in ids2d]

    def jte_step():
        return embedding.preprocess_sparse_dense_matmul_input(
            jte_feats, jte_weights, specs, 1, 1, num_sc_per_device=NUM_SC
        )

    # Same answer on the first table (row pointers everywhere, COO slots up to each SC's end).
    with _Quiet():
        theirs, _ = jte_step()
    ours, _ = tpurec_step()[0]
    m = theirs.sparse_dense_matmul_input
    rp = m.lhs_row_pointers["t0"]
    match = (
        bool(np.array_equal(ours.row_pointers.numpy(), rp))
        and ours.embedding_ids.numel() == m.lhs_embedding_ids["t0"].size
    )
    if match:
        slots = ours.embedding_ids.numel() // NUM_SC
        ends = rp.reshape(NUM_SC, -1)[:, -1]
        for s in range(NUM_SC):
            sl = slice(s * slots, s * slots + int(ends[s]))
            match &= np.array_equal(ours.embedding_ids.numpy()[sl], m.lhs_embedding_ids["t0"][sl])
            match &= np.array_equal(ours.sample_ids.numpy()[sl], m.lhs_sample_ids["t0"][sl])

    if not match:  # equal work, checked once: a comparison of different outputs is not reported
        raise UnequalWork(f"pooling {pooling}: tpurec's CSR of table t0 differs from jax-tpu-embedding's")
    load_before = rounds.load_average()[0]
    orders: list = []
    with _Quiet():
        r_ours, r_jte, r_loop = timer.interleaved(
            [tpurec_step, jte_step, tpurec_loop_step], warmup=warmup, repeats=repeats, orders=orders, seed=order_seed
        )
    t_ours, t_jte, t_loop = r_ours.median, r_jte.median, r_loop.median
    summary = rounds.ratio_summary(r_ours.wall, r_jte.wall)
    return {
        "tpurec_samples_per_s": batch_size / t_ours,
        "jte_samples_per_s": batch_size / t_jte,
        "ratio_vs_jte": summary["ratio"],  # median over rounds of jte seconds / tpurec seconds
        "min": summary["min"],
        "max": summary["max"],
        "round_ratios": summary["round_ratios"],
        "first_in_round": [("tpurec", "jte", "tpurec_loop")[o[0]] for o in orders],
        "load_average_1min": [load_before, rounds.load_average()[0]],
        "tpurec_step_ms": 1e3 * t_ours,
        "tpurec_loop_samples_per_s": batch_size / t_loop,
        "jte_step_ms": 1e3 * t_jte,
        "ids_per_step": batch_size * pooling * num_features,
        "max_ids_per_partition_limits": [mi for mi, _ in limits],
        "outputs_match": bool(match),
    }


def run(
    quick: bool = False,
    as_json: bool = False,
    *,
    batch_size: int = 2048,
    num_features: int = 26,
    vocab: int = 100_000,
    poolings: tuple[int, ...] = (1, 20),
    zipf_a: float = 1.05,
    threads: int | None = None,
    repeats: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
) -> dict:
    """Run the benchmark; print text (or JSON with as_json) and return the figures."""
    threads = threads or os.cpu_count() or 1
    # Read by jax-tpu-embedding when it creates its thread pool (first preprocessing call).
    os.environ["SPARSECORE_INPUT_PREPROCESSING_THREADS"] = str(threads)
    import torch

    repeats = repeats or (3 if quick else 15)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    order_seed = rounds.fresh_seed()
    load_start = rounds.load_average()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per = {
            f"pooling_{pf}": _bench_pooling(
                pf,
                batch_size=batch_size,
                num_features=num_features,
                vocab=vocab,
                zipf_a=zipf_a,
                seed=seed,
                warmup=warmup,
                repeats=repeats,
                threads=threads,
                order_seed=order_seed,
            )
            for pf in poolings
        }
    finally:
        torch.set_num_threads(saved_threads)
    worst = min(per, key=lambda k: per[k]["ratio_vs_jte"])
    import jax_tpu_embedding

    res = {
        "tpurec_samples_per_s": per[worst]["tpurec_samples_per_s"],
        "jte_samples_per_s": per[worst]["jte_samples_per_s"],
        "ratio_vs_jte": per[worst]["ratio_vs_jte"],
        "worst_pooling": worst,
        "worst_round_ratio_vs_jte": min(p["min"] for p in per.values()),
        "order_seed": order_seed,
        "load_average": {"start": load_start, "end": rounds.load_average()},
        **per,
        "batch_size": batch_size,
        "num_features": num_features,
        "vocab": vocab,
        "zipf_a": zipf_a,
        "num_sc_per_device": NUM_SC,
        "global_device_count": 1,
        "threads": threads,
        "thread_settings": f"torch.set_num_threads({threads}); SPARSECORE_INPUT_PREPROCESSING_THREADS={threads}",
        "repeats": repeats,
        "warmup": warmup,
        "quick": quick,
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": _cpu_model(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "jax_tpu_embedding": getattr(jax_tpu_embedding, "__version__", "0.1.0"),
        },
    }
    if as_json:
        print(strict_json.dumps(res, indent=2))
    else:
        print(
            f"SparseCore preprocessing: {num_features} tables x batch {batch_size}, "
            f"Zipf({zipf_a}) over {vocab:,} rows, "
            f"{NUM_SC} SparseCores, 1 device, {threads} threads each"
        )
        for k, v in per.items():
            print(
                f"  {k:11s} tpurec {v['tpurec_samples_per_s']:>12,.0f} samples/s  jax-tpu-embedding "
                f"{v['jte_samples_per_s']:>12,.0f} samples/s  ratio {v['ratio_vs_jte']:.2f} "
                f"[{v['min']:.2f}, {v['max']:.2f}]"
            )
        print(
            f"  worst median ratio {res['ratio_vs_jte']:.2f} ({worst}), worst round "
            f"{res['worst_round_ratio_vs_jte']:.2f}; medians of {repeats} rounds in random order; load average "
            f"{load_start[0]} at start, {res['load_average']['end'][0]} at end"
        )
    return res


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="SparseCore input preprocessing vs jax-tpu-embedding's C++ path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.add_argument(
        "--batch-size", type=positive_int, default=2048, help="device batch size: samples per step (default 2048)"
    )
    p.add_argument("--threads", type=int, default=None, help="threads for both sides (default: all cores)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per side (default 15, --quick 3)")
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        run(quick=args.quick, as_json=args.json, batch_size=args.batch_size, threads=args.threads, repeats=args.repeats)
    except UnequalWork as e:
        print(f"tpurec bench preprocess: error: unequal work, not reported: {e}", file=sys.stderr)
        return 1
    return 0


def jte_feature_specs(features, batch_size: int, num_sc: int = NUM_SC) -> list:
    """jax-tpu-embedding FeatureSpecs (SGD, sum), one per (feature name, table name, vocabulary,
    dim, ids per sample, (max ids, max unique ids) per partition), prepared for one device with
    `num_sc` SparseCores and a COO buffer sized from the limits as tpurec sizes its own."""
    from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

    from tpurec.embedding.constraints import coo_entries_per_sc

    specs = []
    for name, table, vocab, dim, per_sample, (mi, mu) in features:
        spec = embedding_spec.TableSpec(
            name=table,
            vocabulary_size=vocab,
            embedding_dim=dim,
            initializer=lambda *a, **k: None,
            optimizer=embedding_spec.SGDOptimizerSpec(),
            combiner="sum",
            max_ids_per_partition=mi,
            max_unique_ids_per_partition=mu,
            suggested_coo_buffer_size_per_device=num_sc * coo_entries_per_sc(mi, num_sc),
        )
        specs.append(
            embedding_spec.FeatureSpec(
                name=name, table_spec=spec, input_shape=[batch_size, per_sample], output_shape=[batch_size, dim]
            )
        )
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=num_sc)
    return specs
