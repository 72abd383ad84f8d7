"""Chip probe 16: does XLA copy the whole donated table in the update programs of `bench tpu-kernels`
on the v5e? (#59's update bar.)

Why: in session 40's kernels matrix both updates grew with the table, not the ids: SGD 3.6 -> 10.2 ms
(XLA's `t.at[ids].add`) and 5.2 -> 9.9 ms (tpurec's `tc_sgd`) from 1M to 4M rows x 128 at the same
131,072 ids, tables donated: about a copy of the table (512 MiB -> 2 GiB, read and written) on each
side. On CPU the same programs scatter in place (input_output_alias, no copy). If the TPU compiler
inserts a copy, the update is paying a table pass per step that an in-place form would not.

Per table size (1M and 4M rows x 128 f32, 16,384 x 8 uniform ids; `--cpu`: a tiny one), each program
compiled for the default JAX device and timed (median of `--reps` after a warm-up; donated state
chained): `tpurec_sgd` (`tpu_bridge.tc_sgd`), `tpurec_adagrad` (`tc_adagrad`, row-wise), `xla_sgd`
(the bench's contender), `table_copy` (`t + 0`, a copy's cost), `touch_one` (one row added to, table
donated). From each compiled program's text: the instructions that copy a table-shaped array (`copy`,
`copy-start`), the opcodes of all that make one, and the input-output aliases; whether each donated
input was deleted (donation honoured); with --hlo-dir, the first size's compiled programs there.

Session 41 (chip): no table copy in any update program, tables aliased (XLA's scatters run in place,
`scatter_custom_fusion` aliased to the table), yet SGD took 6.2 -> 11.0 ms and XLA's 4.2 -> 10.8 ms
from 1M to 4M rows, as a copy (2.2 -> 7.0 ms): `touch_one` asks whether a program that changes one
row pays it too, `xla_sgd_1k` whether XLA's scatter of 1,024 rows does.

    python3 scripts/tpu_probe_update_copies.py         # on the chip: $OUT/update_copies.json
    python3 scripts/tpu_probe_update_copies.py --cpu   # tiny, on CPU JAX (tests/scripts)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = [1_000_000, 4_000_000]
CPU_ROWS = [3_000]


def table_copies(hlo: str, rows: int, width: int) -> list[str]:
    """The compiled program's instructions that copy a [rows, width] f32 array (layout suffix or not)."""
    shape = re.compile(rf"f32\[{rows},{width}\](\{{[^}}]*\}})?\s+(copy|copy-start)\(")
    return [line.strip()[:160] for line in hlo.splitlines() if shape.search(line)]


def table_ops(hlo: str, rows: int, width: int) -> list[str]:
    """The opcodes of every instruction whose result is a [rows, width] f32 array (a fusion, a
    custom call or a layout change would pass a whole table without a `copy`)."""
    shape = re.compile(rf"=\s*f32\[{rows},{width}\](\{{[^}}]*\}})?\s+([\w-]+)\(")
    return sorted({m.group(2) for line in hlo.splitlines() if (m := shape.search(line))})


def programs(inp: dict[str, Any], batch: int, width: int) -> dict[str, Any]:
    """name -> (jitted program, how many leading arguments are donated state)."""
    import jax
    import jax.numpy as jnp

    from tpurec.embedding.tensorcore import tpu_bridge

    lay = inp["layout"]
    grad = jax.random.normal(jax.random.key(1), (batch, width), jnp.float32)
    lr, eps = jnp.float32(0.01), jnp.float32(1e-8)
    sgd = jax.jit(lambda t, csr: tpu_bridge.tc_sgd(*csr, t, grad, lr, *lay), donate_argnums=0)
    ada = jax.jit(lambda t, a, csr: tpu_bridge.tc_adagrad(*csr, t, a, grad, lr, eps, *lay), donate_argnums=(0, 1))

    @functools.partial(jax.jit, donate_argnums=0)
    def xla_sgd(t: Any, ids: Any, samples: Any) -> Any:
        return t.at[ids].add(grad[samples] * -lr)

    return {
        "tpurec_sgd": (sgd, 1, (inp["csr"],)),
        "tpurec_adagrad": (ada, 2, (inp["csr"],)),
        "xla_sgd": (xla_sgd, 1, (inp["ids"], inp["samples"])),
        "table_copy": (jax.jit(lambda t: t + 0), 0, ()),
        # one row changed in a donated table: any time that grows with the table is not the scatter's
        "touch_one": (jax.jit(lambda t: t.at[0].add(1.0), donate_argnums=0), 1, ()),
        # XLA's scatter of 1,024 rows: does the scatter itself pay a term that grows with the table?
        "xla_sgd_1k": (xla_sgd, 1, (inp["ids"][:1024], inp["samples"][:1024])),
    }


def run_size(rows: int, width: int, batch: int, pooling: int, reps: int, hlo_dir: Path | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpurec.bench import tpu_kernels

    g = np.random.default_rng(rows)
    inp = tpu_kernels.inputs_for(g.integers(0, rows, batch * pooling), np.repeat(np.arange(batch), pooling), batch)
    out: dict[str, Any] = {"rows": rows, "width": width, "ids": batch * pooling, "programs": {}}
    for name, (prog, donated, rest) in programs(inp, batch, width).items():
        table = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32)
        state = [table, jnp.zeros((rows,), jnp.float32)][: max(donated, 1)]
        hlo = prog.lower(*state, *rest).compile().as_text()
        if hlo_dir is not None and name != "table_copy":  # the programs themselves, to read
            (hlo_dir / f"hlo_{name}.txt").write_text(hlo[:400_000])
        times, donated_ok = [], True
        for i in range(reps + 1):
            t0 = time.perf_counter()
            r = jax.block_until_ready(prog(*state, *rest))
            if i:
                times.append(time.perf_counter() - t0)
            if donated:
                donated_ok &= all(x.is_deleted() for x in state[:donated])  # donation honoured
                state = list(r) if isinstance(r, tuple) else [r]
        out["programs"][name] = {
            "ms": 1e3 * float(np.median(times)),
            "table_copies": table_copies(hlo, rows, width),
            "table_ops": table_ops(hlo, rows, width),
            "donated_inputs_deleted": donated_ok if donated else None,
            "aliases": m.group(1)
            if (m := re.search(r"input_output_alias=(\{.*?\}), entry_computation", hlo))
            else None,
        }
        print(json.dumps({"rows": rows, name: out["programs"][name]}), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="a tiny table on CPU JAX")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--hlo-dir", help="write the first size's compiled programs here (hlo_<name>.txt)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "update_copies.json"))
    args = p.parse_args(argv)
    import jax

    doc: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "sizes": []}
    for i, rows in enumerate(CPU_ROWS if args.cpu else ROWS):
        batch = 64 if args.cpu else 16384
        hlo_dir = Path(args.hlo_dir) if args.hlo_dir and not i else None
        doc["sizes"].append(run_size(rows, 128, batch, 8, 1 if args.cpu else args.reps, hlo_dir))
        Path(args.out).write_text(json.dumps(doc, indent=1))  # after each size: a timed-out run keeps them
    return doc


if __name__ == "__main__":
    main()
