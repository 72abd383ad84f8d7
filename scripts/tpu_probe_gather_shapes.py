"""Chip probe 14: how XLA's row gather (`jnp.take`) on the v5e depends on the number of ids, the
index mode and the ids' order (#59's lookup bar: the gather is the lookup's floor).

Why: in probe 13 (session 40) `jnp.take` of 131,072 uniform ids from a 1M x 128 f32 table took
1.17 ms (57 GB/s of rows) but of 130,396 ids 0.71 ms (94 GB/s), and the bag-major gather of
262,144 slots 3.58 ms: the gather's cost is not linear in the ids. If some counts (a power of two,
a size over 2^17) take a slow path, the TensorCore kernel can pad or split its gathers to the fast
one, and the lookup floor drops with it.

Contenders per size (interleaved in a random order per round, `tpu_kernels._time`; all gather the same
rows, checked once):
- `take_fill`: `jnp.take(t, ids, axis=0)` (mode "fill": the bench's XLA contender);
- `index_clip`: `t[ids]` (clamped indices: tpurec's lookup);
- `take_inbounds`: `t.at[ids].get(mode="promise_in_bounds")` (no clamp, no fill);
- `halves`: two `take`s of half the ids each, concatenated (a gather under 2^17 ids each);
- `sorted`: `take` of the same ids sorted (row locality; not the same output order);
- `scatter_add` (only when named in --forms): `t.at[ids].add(u)` into a second table, donated and
  chained call to call (the update programs' scatter): does the scatter follow the gather's count rule
  (session 41: slow where padding the count to a multiple of 1,024 adds fewer than 128)?

Session 40's sweep (`gather-sweep`) found two speeds only (1M x 128: 0.58 ms or 1.36 ms at ~131k ids,
clamped indexing) in runs of consecutive sizes: `--placements K` (step `gather-placement`) times each
size with the table placed K ways and the same ids, and records the buffers' device addresses, to tell
a size rule (which the kernel could pad to) from a placement one.

    python3 scripts/tpu_probe_gather_shapes.py          # on the chip: $OUT/gather_shapes.json
    python3 scripts/tpu_probe_gather_shapes.py --cpu    # tiny sizes on CPU JAX (tests/scripts)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 1_000_000
SIZES = [65_536, 98_304, 130_396, 131_064, 131_072, 131_080, 196_608, 262_144]  # ids a gather
WIDTHS = {128: SIZES, 64: [130_396, 131_072], 16: [130_396, 131_072]}
CPU = (2_000, {128: [96, 128]})


def contenders(table: Any, ids: Any, forms: list[str] | None = None) -> dict[str, Any]:
    """name -> a no-argument call gathering `ids`' rows of `table` (jitted; `sorted` on sorted ids);
    only `forms` where given."""
    import jax
    import jax.numpy as jnp

    h = ids.shape[0] // 2
    fill = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
    clip = jax.jit(lambda t, i: t[i])
    inb = jax.jit(lambda t, i: t.at[i].get(mode="promise_in_bounds"))
    halves = jax.jit(lambda t, i: jnp.concatenate([jnp.take(t, i[:h], axis=0), jnp.take(t, i[h:], axis=0)]))
    ordered = jnp.sort(ids)
    calls: dict[str, Any] = {
        "take_fill": lambda: fill(table, ids),
        "index_clip": lambda: clip(table, ids),
        "take_inbounds": lambda: inb(table, ids),
        "halves": lambda: halves(table, ids),
        "sorted": lambda: fill(table, ordered),
    }
    if forms is not None and "scatter_add" in forms:
        calls["scatter_add"] = _chained_scatter(table, ids)
    return {k: v for k, v in calls.items() if forms is None or k in forms}


def _chained_scatter(table: Any, ids: Any) -> Any:
    """A call adding a row per id into a copy of `table`, donated and carried from call to call (no
    table copy per call, as the update programs run)."""
    import jax
    import jax.numpy as jnp

    add = jax.jit(lambda t, i, u: t.at[i].add(u), donate_argnums=0)
    updates = jnp.full((ids.shape[0], table.shape[1]), 1e-3, table.dtype)
    state = {"t": table + 0}  # its own buffer: the gathers keep reading `table`

    def call() -> Any:
        state["t"] = add(state["t"], ids, updates)
        return state["t"]

    return call


def _pointer(x: Any) -> int | None:
    """The array's device address (where JAX gives it): does a fast gather follow the placement?"""
    try:
        return int(x.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 (not every backend or JAX version has it)
        return None


def run_size(
    rows: int,
    width: int,
    n: int,
    rounds: int,
    reps: int,
    rng: random.Random,
    forms: list[str] | None = None,
    placement: int | None = None,
) -> dict[str, Any]:
    """One size timed. placement k (the --placements mode): the table allocated after a spacer of
    k x (37 MiB + 4 KiB), kept alive while timed, and the ids the first n of one fixed draw (the same
    ids at every size): the size and the buffers' placement apart from the ids' values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpurec.bench import tpu_kernels

    spacer = jnp.zeros(((37 << 20) + 4096) * placement // 4, jnp.float32) if placement else None
    table = jax.random.normal(jax.random.key(width), (rows, width), jnp.float32)
    if placement is None:
        ids_np = np.random.default_rng(n + width).integers(0, rows, n)
    else:
        ids_np = np.random.default_rng(0).integers(0, rows, max(n, 2_200_000))[:n]
    ids = jnp.asarray(ids_np.astype(np.int32))
    calls = contenders(table, ids, forms)
    want = np.asarray(tpu_kernels._block(contenders(table, ids, ["take_fill"])["take_fill"]()))
    for k in {"index_clip", "take_inbounds", "halves"} & set(calls):  # equal work: the same rows, in order
        if not np.array_equal(np.asarray(tpu_kernels._block(calls[k]())), want):
            raise AssertionError(f"{rows}x{width} {n} ids: {k} gathered other rows than take_fill")
    secs = tpu_kernels._time(calls, rounds, reps, rng)
    ms = {k: 1e3 * float(np.median(v)) for k, v in secs.items()}
    del spacer  # (alive until the timing's end)
    return {
        "table": f"{rows}x{width} float32",
        "ids": n,
        "placement": placement,
        "table_address": _pointer(table),
        "ids_address": _pointer(ids),
        "ms": ms,
        "GBps_rows": {k: n * width * 4 / v / 1e6 for k, v in ms.items()},
        "ns_per_id": {k: v * 1e6 / n for k, v in ms.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU JAX")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sizes", help="ids a gather, comma-separated, at width 128 (a sweep; default: SIZES, WIDTHS)")
    p.add_argument("--forms", help="the contenders timed, comma-separated (default: all)")
    p.add_argument("--placements", type=int, help="each size with the table placed K ways (run_size's placement)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "gather_shapes.json"))
    args = p.parse_args(argv)
    forms = args.forms.split(",") if args.forms else None
    import jax

    rng = random.Random(0)
    rounds, reps = (1, 1) if args.cpu else (args.rounds, args.reps)
    rows, widths = CPU if args.cpu else (ROWS, WIDTHS)
    if args.sizes:
        widths = {128: [int(x) for x in args.sizes.split(",")]}
    doc: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cells": []}
    for width, sizes in widths.items():
        for n in sizes:
            for k in range(args.placements) if args.placements else [None]:
                doc["cells"].append(run_size(rows, width, n, rounds, reps, rng, forms, placement=k))
                print(json.dumps(doc["cells"][-1]), flush=True)
                Path(args.out).write_text(json.dumps(doc, indent=1))  # after each: a timed-out run keeps them
    return doc


if __name__ == "__main__":
    main()
