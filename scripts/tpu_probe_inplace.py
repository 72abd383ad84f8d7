"""Chip probe 12: how the TensorCore kernel's table update could land in the module's storage.

Today the row-wise Adagrad program (tpu_bridge.tc_adagrad) returns a new table and accumulator and
the op copies them back (`copy_`): XLA's scatter into an operand it may not overwrite copies the
table first, and the `copy_` moves it again, ~1.5 ms per 512 MB each (docs/tensorcore.md), so a 1 GiB
stack pays ~6 ms a step before any row is updated; MLPerf DLRM-DCNv2's 6.3 GiB of stacks ~38 ms of
the step's ~163 ms of table updates (session 35). Routes timed here, each on one stack-sized table:

- `copy`: the route of today (program not donated; `copy_` of table and accumulator);
- `rows`: the program returns only the updated rows (their indices, new rows, new accumulator
  values; a padding slot repeats the first real row, so every index is in range and duplicates write
  equal values), landed by torch's in-place `index_copy_` on the device; `rows_quarter` the same rows
  into a table of a quarter of the rows: if `rows` costs more, TorchTPU's `index_copy_` copies the
  table too;
- `donate_set`: the program with table and accumulator donated, the parameters given the results'
  storage (`set_`; probe 2: 3.4 against 5.0 ms at 1M x 128 for SGD).

After each route a per-table view taken before it (what `state_dict()` hands out: rows 1,000-1,999 of
the stack) is compared with the stack: `view_follows` true when the view sees the update (the
TorchRec contract), else false or the error reading it raised; for `donate_set` also after the view
is re-pointed at the new storage (`view.set_(storage, offset, size, stride)`, `view_repointed`). Each
route's first update is checked against the CPU reference (`max_abs_err`). Median of --reps after
one untimed run, ms. JSON on stdout and in $OUT/probe12_inplace.json.

`--cpu` runs it all on the CPU with a stand-in for TorchTPU's `jax_op` (no donation there): a smoke
run of the programs and the checks, at a small shape (tests/scripts/test_tpu_probe_inplace.py).
Usage: python3 scripts/tpu_probe_inplace.py [--cpu] [--rows 2000000] [--distinct 400000] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

VIEW = slice(1000, 2000)  # a table's rows inside the stack, as state_dict() views them


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--cpu", action="store_true", help="the CPU and a jax_op stand-in (a smoke run)")
    p.add_argument("--rows", type=int, default=2_000_000, help="the stack's rows (2M x 128 f32: 1 GiB)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--distinct", type=int, default=400_000, help="the update's slots (MLPerf's biggest stack: ~410k)")
    p.add_argument("--padding", type=float, default=0.05, help="share of the update's slots that are padding")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def rowwise_adagrad_rows(
    table: jax.Array, acc: jax.Array, rows: jax.Array, grads: jax.Array, lr: jax.Array, eps: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(new rows, new accumulator values) of `rows` (padding rows past the table read zeros), as
    update_jax.adagrad computes them for a 1-D accumulator."""
    norm_sq = jnp.square(jnp.sqrt(jnp.sum(grads * grads, axis=1)))
    new_acc = acc.at[rows].get(mode="fill", fill_value=0) + norm_sq / jnp.float32(grads.shape[1])
    old = table.at[rows].get(mode="fill", fill_value=0)
    return old + grads * (-lr / (jnp.sqrt(new_acc) + eps))[:, None], new_acc


def whole(
    table: jax.Array, acc: jax.Array, rows: jax.Array, grads: jax.Array, lr: jax.Array, eps: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The new table and accumulator (the `copy` and `donate_set` routes' program)."""
    new_rows, new_acc = rowwise_adagrad_rows(table, acc, rows, grads, lr, eps)
    return table.at[rows].set(new_rows, mode="drop"), acc.at[rows].set(new_acc, mode="drop")


def rows_only(
    table: jax.Array, acc: jax.Array, rows: jax.Array, grads: jax.Array, lr: jax.Array, eps: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(indices, new rows, new accumulator values), every index in range: a padding slot (row past
    the table) repeats the first real slot's row and values, so an `index_copy_` of them all writes
    each row once in effect (equal values where repeated); with no real slot, row 0 as it is."""
    valid = rows < table.shape[0]
    new_rows, new_acc = rowwise_adagrad_rows(table, acc, rows, grads, lr, eps)
    first = jnp.argmax(valid)
    any_valid = valid[first]
    fill_row = jnp.where(any_valid, rows[first], 0)
    fill_vals = jnp.where(any_valid, new_rows[first], table[0])
    fill_acc = jnp.where(any_valid, new_acc[first], acc[0])
    idx = jnp.where(valid, rows, fill_row)
    return idx, jnp.where(valid[:, None], new_rows, fill_vals[None, :]), jnp.where(valid, new_acc, fill_acc)


def cpu_jax_op(name: str, donate_argnums: tuple[int, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """The CPU stand-in for `torch_tpu._internal.pallas.jax_op`: the function jitted, run on the
    tensors' data, its outputs handed back as new torch tensors (nothing donated)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        jitted = jax.jit(fn)

        def call(*args: torch.Tensor) -> Any:
            out = jitted(*(jnp.asarray(a.detach().numpy()) for a in args))
            outs = out if isinstance(out, tuple) else (out,)
            moved = tuple(torch.from_numpy(np.array(o)) for o in outs)
            return moved if isinstance(out, tuple) else moved[0]

        return call

    return wrap


def drain(t: torch.Tensor) -> None:
    t.reshape(-1)[:1].cpu()


def timed(fn: Callable[[], torch.Tensor], reps: int) -> dict:
    drain(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        drain(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": float(f"{statistics.median(times):.4g}"), "min_ms": float(f"{min(times):.4g}")}


def view_check(view: torch.Tensor, table: torch.Tensor) -> bool | str:
    """Whether `view` (taken before the route) reads what the stack now holds."""
    try:
        return bool(torch.equal(view.cpu(), table[VIEW].cpu()))
    except Exception as ex:  # the view's buffer given away
        return f"{type(ex).__name__}: {str(ex)[:200]}"


class Probe:
    def __init__(self, a: argparse.Namespace, dev: torch.device, jax_op: Callable[..., Any]) -> None:
        self.a, self.dev = a, dev
        gen = np.random.default_rng(a.seed)
        self.host_table = torch.from_numpy(gen.standard_normal((a.rows, a.dim), dtype=np.float32))
        self.host_acc = torch.from_numpy(gen.random(a.rows, dtype=np.float32))
        real = int(a.distinct * (1 - a.padding))
        rows = np.full(a.distinct, a.rows, np.int32)  # padding: past the table
        rows[:real] = np.sort(gen.choice(a.rows, real, replace=False))
        self.host_rows = torch.from_numpy(rows)
        # as many real rows within a quarter of the table (`rows_quarter`: the same work, a smaller table)
        quarter = np.full(a.distinct, a.rows // 4, np.int32)
        quarter[:real] = np.sort(gen.choice(a.rows // 4, real, replace=False))
        self.quarter_rows = torch.from_numpy(quarter).to(dev)
        self.host_grads = torch.from_numpy(gen.standard_normal((a.distinct, a.dim), dtype=np.float32))
        self.rows, self.grads = self.host_rows.to(dev), self.host_grads.to(dev)
        self.lr, self.eps = torch.tensor(0.01).to(dev), torch.tensor(1e-8).to(dev)
        self.whole = jax_op("tpurec_probe12::whole")(whole)
        self.whole_donated = jax_op("tpurec_probe12::whole_donated", donate_argnums=(0, 1))(whole)
        self.rows_only = jax_op("tpurec_probe12::rows_only")(rows_only)

    def fresh(self, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.a.rows if rows is None else rows
        return self.host_table[:n].clone().to(self.dev), self.host_acc[:n].clone().to(self.dev)

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One update on the host (torch, float32), as the programs compute it."""
        table, acc = self.host_table.clone(), self.host_acc.clone()
        real = self.host_rows < self.a.rows
        r, g = self.host_rows[real].long(), self.host_grads[real]
        acc[r] += (g * g).sum(1).sqrt().square() / self.a.dim
        table[r] += g * (-0.01 / (acc[r].sqrt() + 1e-8))[:, None]
        return table, acc

    def route(self, name: str, table: torch.Tensor, acc: torch.Tensor) -> Callable[[], torch.Tensor]:
        args = (self.quarter_rows if name == "rows_quarter" else self.rows, self.grads, self.lr, self.eps)

        def copy() -> torch.Tensor:
            new_t, new_a = self.whole(table, acc, *args)
            table.copy_(new_t)
            acc.copy_(new_a)
            return table

        def rows() -> torch.Tensor:
            idx, new_rows, new_acc = self.rows_only(table, acc, *args)
            table.index_copy_(0, idx.long(), new_rows)
            acc.index_copy_(0, idx.long(), new_acc)
            return table

        def donate_set() -> torch.Tensor:
            new_t, new_a = self.whole_donated(table, acc, *args)
            table.set_(new_t)
            acc.set_(new_a)
            return table

        return {"copy": copy, "rows": rows, "rows_quarter": rows, "donate_set": donate_set}[name]

    def run(self, name: str) -> dict:
        rec: dict[str, Any] = {}
        try:
            quarter = name == "rows_quarter"
            table, acc = self.fresh(self.a.rows // 4 if quarter else None)
            view = table[VIEW]
            step = self.route(name, table, acc)
            with torch.no_grad():
                step()
                if not quarter:
                    want_t, want_a = self.expected()
                    err = max(float((table.cpu() - want_t).abs().max()), float((acc.cpu() - want_a).abs().max()))
                    rec["max_abs_err"] = float(f"{err:.3g}")
                rec["view_follows"] = view_check(view, table)
                if name == "donate_set":
                    view.set_(table.untyped_storage(), view.storage_offset(), view.size(), view.stride())
                    rec["view_repointed"] = view_check(view, table)
                rec.update(timed(step, self.a.reps))
        except Exception as ex:  # a route the device refuses: said, the others still run
            rec["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        return rec


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.cpu:
        dev, jax_op = torch.device("cpu"), cpu_jax_op
    else:
        from torch_tpu._internal.pallas import jax_op as tpu_jax_op  # private: a probe may call it

        dev, jax_op = torch.device("tpu"), tpu_jax_op
    probe = Probe(a, dev, jax_op)
    doc: dict[str, Any] = {"probe": "tpu_probe_inplace", "device": str(dev), "torch": torch.__version__}
    doc["shape"] = {k: getattr(a, k) for k in ("rows", "dim", "distinct", "padding", "reps")}
    doc["routes"] = {name: probe.run(name) for name in ("copy", "rows", "rows_quarter", "donate_set")}
    text = json.dumps(doc, indent=1)
    print(text, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe12_inplace.json"), "w") as f:
        f.write(text)
    return doc


if __name__ == "__main__":
    main()
