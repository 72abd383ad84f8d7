"""The plain-JAX contender of `tpurec bench tpu-train`, one round per process.

`python -m tpurec.bench.tpu_train_jax WORKLOAD_JSON --warmup W --steps T --batches K [--precision P]`
prints one JSON line: samples/s over the T timed steps (after W warm-up steps, the device drained with
`block_until_ready` before and after), the step time, the first step's seconds (compiling included),
the losses, and the bytes the parameters and the optimizer state take (with the device's own memory
figures where it gives them: a TPU does, a CPU does not).

A process per round, as tpurec's side gets: a TPU is opened by one process at a time, so the JAX
contender must let go of the chip before `tpurec train` can take it. The data: K batches of
`tpurec.data.synth` (the generator `tpurec train`'s data come from: with the same seed and a row
group per batch they are the first K row groups of the Parquet data tpurec's side reads), cycled. With
`--feed host` (the default since session 34) each step's batch crosses from the host as a JAX user's
loop moves it (`jax.device_put` of its numpy arrays before the step; JAX's async dispatch overlaps
it with the step before), as tpurec's side moves its inputs every step; `--feed device` puts them on
the device once, before the timing: no host input in the figure (an upper bound for JAX, sessions
29-34's contender).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from tpurec.bench.tpu_train_shapes import Workload


def data_schema(w: Workload) -> Any:
    """The synthetic data's schema and ids per sample: features C1..C26 over the capped tables."""
    from tpurec.data.synth import features_schema

    return features_schema(w.num_dense, [(f"C{i + 1}", r, h) for i, (r, h) in enumerate(zip(w.rows, w.hots))])


def host_batches(w: Workload, count: int) -> list[dict[str, Any]]:
    """The first `count` batches of the synthetic data (numpy): ids per table (flat, sample-major:
    [batch * hots]; a TPU pads a [batch, 1] int32 array's minor dim to 128 lanes, a flat one hardly at
    all), dense [batch, 13], labels [batch]."""
    from tpurec.data.synth import generate_chunk

    schema, hots = data_schema(w)
    out = []
    for k in range(count):
        cols, _, labels = generate_chunk(w.seed, k, w.batch, schema, hots)
        ids = [
            np.asarray(cols[f.name].flatten() if f.multi_hot else cols[f.name]).astype(np.int32).reshape(w.batch * h)
            for f, h in zip(schema.sparse, hots)
        ]
        dense = np.stack([np.asarray(cols[d]) for d in schema.dense], axis=1).astype(np.float32)
        out.append({"ids": ids, "dense": dense, "labels": labels.astype(np.float32)})
    return out


def _bytes(tree: Any) -> int:
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def train(w: Workload, batches: list[dict[str, Any]], warmup: int, steps: int, feed: str = "host") -> dict:
    """W warm-up then T timed steps cycling over `batches`, each moved to the device at its step
    (feed "host") or all once before (feed "device"); the figures (see the module docstring)."""
    import jax

    from tpurec.bench.tpu_train_jax_model import init_params
    from tpurec.bench.tpu_train_jax_step import init_state, jitted_step

    step = jitted_step(w)
    params = init_params(w, jax.random.key(w.seed))
    state = init_state(params)
    sizes = {
        "table_bytes": _bytes([params["tables"], state["tables"]]),
        "dense_bytes": _bytes([params["dense"], state["dense"]]),
    }
    kept = [jax.device_put(b) for b in batches] if feed == "device" else None

    def batch(i: int) -> Any:
        return kept[i % len(kept)] if kept is not None else jax.device_put(batches[i % len(batches)])

    t0 = time.perf_counter()
    params, state, loss = step(params, state, batch(0))
    first: list[Any] = [float(jax.block_until_ready(loss))]
    first_s = time.perf_counter() - t0
    for i in range(1, warmup):
        params, state, loss = step(params, state, batch(i))
        first.append(loss)
    jax.block_until_ready((params, state))
    timed: list[Any] = []
    t0 = time.perf_counter()
    for i in range(steps):
        params, state, loss = step(params, state, batch(warmup + i))
        timed.append(loss)  # kept on the device: reading it here would sync every step
    jax.block_until_ready((params, state))
    secs = time.perf_counter() - t0
    return {
        "samples_per_s": round(steps * w.batch / secs, 1),
        "step_ms": round(secs / steps * 1e3, 3),
        "first_step_s": round(first_s, 3),
        "feed": feed,
        "losses": [round(float(x), 6) for x in [*first, *timed]],
        **sizes,
        "memory": _memory_stats(),
    }


def _memory_stats() -> dict | None:
    """The device's own figures (bytes in use, peak, limit); None where it gives none (a CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpurec.bench.tpu_train_jax")
    p.add_argument("workload", help="tpu_train_shapes.Workload as JSON")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled on the device")
    p.add_argument("--precision", default="default", help="jax_default_matmul_precision")
    p.add_argument("--feed", choices=("host", "device"), default="host", help="batches moved each step, or once")
    args = p.parse_args(argv)
    import jax

    from tpurec import strict_json

    jax.config.update("jax_default_matmul_precision", args.precision)
    w = Workload.from_json(args.workload)
    out = train(w, host_batches(w, args.batches), max(1, args.warmup), args.steps, args.feed)
    out.update(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(), jax=jax.__version__)
    out["matmul_precision"] = args.precision
    print(strict_json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
