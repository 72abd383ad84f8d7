"""The host half of `bench tpu-train`'s step on the CPU: `KernelInput.preprocess` at the MLPerf shape.

`python -m tpurec.bench.host_prep [--rounds R] [--batches K]` prints one JSON line. The workload is
`bench tpu-train`'s (tpu_train_shapes.workload: 26 tables capped at 2M rows, dim 128, batch 16,384, 214
ids a sample) and its synthetic batches (tpu_train_jax.host_batches), laid out as the v5e lays them
(the TensorCore kernel's settings: fixed limits with its 10% headroom, 1 GiB stacks, one SparseCore
layout: 8 stacks). The module is built on "meta": preprocessing reads the tables' row counts and
layout, never their rows, so its inputs are the chip's without 6.3 GB of tables (and stay on the host:
`KernelInput.to_device`). A step = `preprocess` (ids -> one CSR input per stack) then the packing
the TPU's copy does first (`input_copy.inputs_to_device`'s concatenation, one tensor per dtype); the
copy over the host link itself is not here.

Contenders: `serial` (TPUREC_HOST_THREADS=1: the stacks one after another) and `threaded` (the default:
the stacks' compiled builds on a thread pool, host_threads.py). Equal work is checked first: on every
batch both give the same arrays and the same stats, else exit 1. Then `rounds` interleaved rounds (each
contender once per round, in a random order: timer.interleaved); per contender the median and worst
round (ms), the ratio serial / threaded per round, each stack's build alone (`stack_ms`: the largest
bounds the threaded step on any core count) and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

SWITCH = "TPUREC_HOST_THREADS"


def build_inputs(w: Any) -> Any:
    """The workload's KernelInput as the v5e builds it (see the module docstring), tables on "meta"."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.embedding.settings import FIRST_BATCH_HEADROOM_TENSORCORE, TENSORCORE_MAX_STACK_BYTES, KernelSettings
    from tpurec.embedding.sparsecores import TENSORCORE_LAYOUT_SPARSECORES

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=w.dim, num_embeddings=r, feature_names=[f"C{i + 1}"])
        for i, r in enumerate(w.rows)
    ]
    # KernelSettings.resolved_for("tpu") on a v5e (tensorcore_only), spelled out: this host is no v5e
    settings = KernelSettings(
        fixed_limits=True,
        pad_dims=True,
        widen_tables=True,
        max_stack_bytes=TENSORCORE_MAX_STACK_BYTES,
        first_batch_headroom=FIRST_BATCH_HEADROOM_TENSORCORE,
    )
    ebc = SparseCoreEmbeddingBagCollection(
        tables,
        RowWiseAdagrad,
        {"lr": w.embedding_lr, "eps": w.eps},
        num_sparsecores=TENSORCORE_LAYOUT_SPARSECORES,
        device=torch.device("meta"),
        settings=settings,
    )
    return ebc.kernel.inputs


def step(inputs: Any, kjt: Any) -> list[Any]:
    """One host half: the stacks' inputs, then packed as the TPU copy packs them (one tensor per dtype)."""
    import torch

    from tpurec.embedding import input_copy

    out = inputs.preprocess(kjt)
    input_copy.inputs_to_device(out, torch.device("cpu"))  # the concatenation; .to("cpu") copies nothing
    return out


def with_threads(value: str | None, fn: Any) -> Any:
    """fn() with TPUREC_HOST_THREADS set to `value` (None: unset, the default pool)."""
    old = os.environ.pop(SWITCH, None)
    if value is not None:
        os.environ[SWITCH] = value
    try:
        return fn()
    finally:
        os.environ.pop(SWITCH, None)
        if old is not None:
            os.environ[SWITCH] = old


def bits(t: Any) -> Any:
    """t's bits as integers of its width (float32 -> int32)."""
    import torch

    return t.view(torch.int32) if t.dtype == torch.float32 else t


def same(a: list[Any], b: list[Any], stats_a: dict, stats_b: dict) -> str | None:
    """None when both steps built the same inputs and stats, else what differs."""
    import torch

    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} stacks"
    for i, (x, y) in enumerate(zip(a, b)):
        for f in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            # bit for bit (the padding's gains are NaN, which no float comparison calls equal)
            if not torch.equal(bits(getattr(x, f)), bits(getattr(y, f))):
                return f"stack {i}: {f} differs"
        if (x.max_ids_per_partition, x.max_unique_ids_per_partition) != (
            y.max_ids_per_partition,
            y.max_unique_ids_per_partition,
        ):
            return f"stack {i}: limits differ"
    if list(stats_a) != list(stats_b):
        return f"stats of stacks {list(stats_a)} vs {list(stats_b)}"
    for k, x in stats_a.items():
        y = stats_b[k]
        if not (torch.equal(x.ids_per_partition, y.ids_per_partition)
                and torch.equal(x.unique_ids_per_partition, y.unique_ids_per_partition)
                and (x.required_buffer_size_per_sc, x.dropped_id_count, x.passes)
                == (y.required_buffer_size_per_sc, y.dropped_id_count, y.passes)):  # fmt: skip
            return f"stack {k}: stats differ"
    return None


def stack_ms(inputs: Any, kjt: Any, repeats: int = 5) -> list[float]:
    """Each stack's compiled build alone (median ms): the largest bounds a threaded step on any number
    of cores (a stack builds on one thread)."""
    import statistics
    import time

    batch, padded, parts = inputs.stack_arrays(kjt, demand=False)
    out = []
    for i, part in enumerate(parts):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            inputs._compiled_csr(i, *part, batch, padded)
            times.append((time.perf_counter() - t) * 1e3)
        out.append(round(statistics.median(times), 2))
    return out


def run(rounds: int, count: int, seed: int) -> dict:
    import torch

    from tpurec.bench.rounds import load_average, ratio_summary
    from tpurec.bench.timer import interleaved
    from tpurec.bench.tpu_train_jax import host_batches
    from tpurec.bench.tpu_train_shapes import CHIP_BATCH, DEFAULT_ROWS_CAP, workload
    from tpurec.bench.tpu_train_split import _kjt
    from tpurec.embedding import host_threads

    w = workload(DEFAULT_ROWS_CAP, CHIP_BATCH)
    kjts = [_kjt(w, b) for b in host_batches(w, count)]
    inputs = build_inputs(w)
    modes = {"serial": "1", "threaded": None}
    for kjt in kjts:  # the first batch fixes the limits; then every batch must give equal work
        outs = {m: with_threads(v, lambda k=kjt: (step(inputs, k), dict(inputs.stats()))) for m, v in modes.items()}
        diff = same(outs["serial"][0], outs["threaded"][0], outs["serial"][1], outs["threaded"][1])
        if diff:
            raise SystemExit(f"unequal work: {diff}")

    def contender(value: str | None) -> Any:
        calls = iter(range(10**9))  # each contender's n-th call takes batch n mod K: both see the same batches
        # nothing kept: held by the timer, the outputs would keep csr_build's buffers from their reuse,
        # and every step would fault in fresh pages (not what a training loop does)
        return lambda: with_threads(value, lambda: step(inputs, kjts[next(calls) % count]) and None)

    load_before = load_average()
    fns = [contender(v) for v in modes.values()]
    orders: list[tuple[int, ...]] = []
    runs = interleaved(fns, warmup=1, repeats=rounds, seed=seed, orders=orders)
    out: dict[str, Any] = {
        "stacks": len(inputs.stacks),
        "ids_per_batch": int(kjts[0].values().numel()),
        "workers": host_threads.workers(len(inputs.stacks)),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    for name, r in zip(modes, runs):
        out[f"{name}_ms"] = round(r.median * 1e3, 2)
        out[f"{name}_worst_ms"] = round(max(r.wall) * 1e3, 2)
    out["serial_over_threaded"] = ratio_summary(runs[1].wall, runs[0].wall)
    out["stack_ms"] = stack_ms(inputs, kjts[0])
    out.update(rounds=rounds, seed=seed, load_before=load_before, load_after=load_average())
    return out


def main(argv: list[str] | None = None) -> int:
    from tpurec import strict_json
    from tpurec.bench.rounds import fresh_seed

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.host_prep")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--batches", type=int, default=2, help="distinct batches, cycled")
    p.add_argument("--seed", type=int, default=None, help="the rounds' orders (default: a fresh one, printed)")
    a = p.parse_args(argv)
    print(strict_json.dumps(run(a.rounds, a.batches, fresh_seed() if a.seed is None else a.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
