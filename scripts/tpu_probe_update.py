"""Chip probe 10: where tpurec's row-wise Adagrad update goes at the MLPerf DCNv2 shape, piece by piece,
against the pure-JAX contender's update (`tpurec bench tpu-train`'s), on the same ids and gradient.

One stack as the TensorCore kernel builds it on a v5e (one SparseCore per device, one partition:
`TENSORCORE_LAYOUT_SPARSECORES`): tables t_C21, t_C22, t_C20 (MLPerf multi-hot 100, 27, 12 ids a sample)
end to end in one `--rows` x 128 f32 stack (default 2,000,000 rows, 1 GiB: the kernel's largest stack on
the chip; in `tpurec bench tpu-train` at its 2M-row cap C20-C22 are 2M rows each, a stack each: `--features
C21` is that run's biggest stack, the default its three busiest features' ids on one stack's rows) with
row-wise Adagrad's one f32 per row, batch 16,384, ids Zipf(`--zipf`) per table
(`tpurec.data.synth`'s ids: `zipf_ids`, then its hot-id scatter). The stacked ids and samples are made
as `KernelInput._stack_entries` makes them and turned into the CSR input by `tpurec.embedding.preprocess`,
with id limits at each `--limits` factor times the batch's own fullest partition (one cell per factor:
the buffers' headroom over the batch; `KernelInput._limits` sets 2x from a first batch).

Timed per cell, each its own jitted program, median of `--reps` after a warm-up (ms):
- `update_program`: tpu_bridge.tc_adagrad as the chip runs it (TorchTPU's jax_op: nothing donated, new
  table and accumulator returned, then copied back into the module's storage); `update_program_donated`:
  the same with table and accumulator donated (what in-place storage would cost; state chained);
  `update_program_rows`: tpu_bridge.tc_adagrad_rows, the rows route (tpurec's default since session 36:
  the changed rows, their accumulator and indices returned, landed by `index_copy_`);
- its pieces, each taking the previous one's outputs: `decode` (CSR -> per-slot row, sample, gain),
  `grad_rows` (gather of the activations' gradient row per slot x gain), `segment_ids` (row starts and
  their running count), `segment_sum` (sorted segment sum of duplicates), `distinct_rows` (the merged rows'
  compaction scatter), `apply` (update_jax.adagrad: gather table and accumulator rows, update, scatter);
  `row_gradients` (decode .. distinct_rows as one program, tpu_bridge._row_gradients);
- `lookup_program`: tpu_bridge.tc_lookup (the Pallas pooling where it fits, as on the chip).
Once (they do not read the CSR): `jax_update` (tpu_train_jax_step.rowwise_adagrad on each table, its
[batch, hots, dim] gradient rows the pooled gradient broadcast over the hots as in the step's backward;
tables and accumulators donated, as `jitted_step` donates), `jax_take_sum` (jnp.take + sum over hots),
`jax_unique`, `jax_segment_sum`, `jax_apply` (rowwise_adagrad's three steps alone, per table), `table_copy`
(a copy of the stack: what the bridge's copy_ back costs, about).
Equal work, once, before the contenders' timing: tpurec's update program and the JAX contender's after one
step from the same tables, gradient of small integers (exact row sums), within rtol = atol = 1e-5
(tpurec.bench.equal_work's tolerance), every row of the stack; the lookups likewise; and per cell the
pieces chained end to end against the update program.

JSON document on stdout (progress on stderr; the document so far in $OUT/upd_partial.json after each
program when OUT is set). A program past `--budget-s` is skipped, so a timed-out run still prints.
Usage: python3 scripts/tpu_probe_update.py [--cpu] [--limits 1.1,2] [--reps 7] [--budget-s 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.bench.equal_work import ATOL, RTOL
from tpurec.bench.tpu_train_jax_step import rowwise_adagrad
from tpurec.data import synth
from tpurec.data.catalog import FEATURE_NAMES, MLPERF_DCNV2_MULTI_HOT
from tpurec.embedding.constraints import DIM_ALIGN, SEGMENT_ALIGN, round_up
from tpurec.embedding.kernel_input import stacked_samples
from tpurec.embedding.layout import StackLayout, build_stacks
from tpurec.embedding.preprocess import SparseCoreInput, preprocess
from tpurec.embedding.sparsecores import TENSORCORE_LAYOUT_SPARSECORES
from tpurec.embedding.tensorcore import csr_jax, pallas_pool, tpu_bridge, update_jax

NUM_SC = TENSORCORE_LAYOUT_SPARSECORES  # one "SparseCore" per device on a TensorCore-only chip
DEVICES = 1  # one chip: partitions = NUM_SC x DEVICES
PIECES = ("decode", "grad_rows", "segment_ids", "segment_sum", "distinct_rows", "apply")
CPU_SHAPE = dict(rows=3_000, batch=64, reps=2, warmup=1)  # and MLPerf's hots / 10 (at least 1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--features", default="C21,C22,C20", help="the stack's features (tables t_<feature>)")
    p.add_argument("--hots", default=None, help="ids a sample per feature (default: MLPerf's multi-hot sizes)")
    p.add_argument("--rows", type=int, default=2_000_000, help="stack rows, split evenly over the tables")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids (synth.zipf_ids)")
    p.add_argument("--limits", default="1.1,2", help="id-limit factors over the batch's fullest partition")
    p.add_argument(
        "--unique-factor",
        type=float,
        default=2.0,
        help="unique-id limit factor over the batch's fullest partition (KernelInput._limits: 2); 0: each --limits",
    )
    p.add_argument("--warmup", type=int, default=1, help="runs after the compiling one, untimed")
    p.add_argument("--reps", type=int, default=7, help="timed runs per program (median reported)")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip programs started after this many seconds")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pieces", action="store_true", help="time only the whole programs")
    p.add_argument("--cpu", action="store_true", help=f"a smoke run at a tiny shape: {CPU_SHAPE}")
    p.add_argument("--out", default=None, help="also write the JSON document here")
    a = p.parse_args(argv)
    if a.cpu:
        for k, v in CPU_SHAPE.items():
            setattr(a, k, v)
    return a


# -- the stack and its input, as tpurec builds them ------------------------------------------------
def stack_layout(names: list[str], rows: list[int], dim: int) -> StackLayout:
    lays = build_stacks([(n, r, dim) for n, r in zip(names, rows)], NUM_SC * DEVICES, pad_to=DIM_ALIGN)
    assert len(lays) == 1, "the tables must fit one stack"
    return lays[0]


def table_ids(a: argparse.Namespace, features: list[str], rows: list[int], hots: list[int]) -> list[np.ndarray]:
    """[batch, hots] int64 ids per table: synth's (Zipf ranks scattered over the table by an affine map)."""
    rng = np.random.default_rng(a.seed)
    out = []
    for f, r, h in zip(features, rows, hots):
        j = FEATURE_NAMES.index(f)
        out.append(synth._scatter(synth.zipf_ids(rng, r, (a.batch, h), a.zipf), r, j))
    return out


def stack_entries(lay: StackLayout, ids: list[np.ndarray], batch: int) -> tuple[torch.Tensor, ...]:
    """(SparseCore ids, device samples, gains) as `KernelInput._stack_entries` makes them (sum pooling)."""
    n = len(ids)
    parts_ids, parts_smp = [], []
    for k, (t, x) in enumerate(zip(lay.tables, ids)):
        h = x.shape[1]
        b = torch.arange(batch).repeat_interleave(h)
        slot = torch.full_like(b, k)
        parts_ids.append(lay.sparsecore_ids(torch.from_numpy(x.reshape(-1)) + t.offset))
        parts_smp.append(stacked_samples(slot, b, n, batch, NUM_SC))
    stacked = torch.cat(parts_ids)
    return stacked, torch.cat(parts_smp), torch.ones(stacked.numel())


def csr_at(
    entries: tuple[torch.Tensor, ...], device_batch: int, factor: float, unique_factor: float, demand: tuple[int, int]
):
    """The CSR input with limits at `factor` x the batch's own fullest partition's ids and
    `unique_factor` (or `factor` if 0) x its unique ids, as KernelInput._limits sets them."""
    max_ids = round_up(max(SEGMENT_ALIGN, int(np.ceil(factor * demand[0]))), SEGMENT_ALIGN)
    uf = unique_factor or factor
    max_uniq = min(round_up(max(SEGMENT_ALIGN, int(np.ceil(uf * demand[1]))), SEGMENT_ALIGN), max_ids)
    csr, stats = preprocess(
        *entries,
        device_batch_size=device_batch,
        num_sc_per_device=NUM_SC,
        global_device_count=DEVICES,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_uniq,
        table_name="stack_d128",
    )
    assert stats.dropped_id_count == 0
    return csr


def device_csr(csr: SparseCoreInput) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(t.numpy()) for t in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains))


# -- timing -----------------------------------------------------------------------------------------
class Clock:
    def __init__(self, a: argparse.Namespace, doc: dict) -> None:
        self.a, self.doc, self.t0 = a, doc, time.monotonic()

    def save(self) -> None:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "upd_partial.json"), "w") as f:
                json.dump(self.doc, f, indent=1)

    def time(self, into: dict, name: str, run: Callable[[], Any], extra: dict | None = None) -> dict:
        """Median ms of `run()` (each run waited for); the first run (compile + run) timed apart."""
        rec: dict[str, Any] = dict(extra or {})
        if time.monotonic() - self.t0 > self.a.budget_s:
            rec["skipped"] = f"past --budget-s {self.a.budget_s:g}"
            into[name] = rec
            log(f"{name}: skipped (budget)")
            return rec
        try:
            t = time.perf_counter()
            jax.block_until_ready(run())
            rec["first_call_s"] = round(time.perf_counter() - t, 3)
            for _ in range(self.a.warmup):
                jax.block_until_ready(run())
            times = []
            for _ in range(self.a.reps):
                t = time.perf_counter()
                jax.block_until_ready(run())
                times.append((time.perf_counter() - t) * 1e3)
            rec["ms"] = round(float(np.median(times)), 4)
            rec["ms_min"] = round(min(times), 4)
            if "row_bytes" in rec:
                rec["GBps_rows"] = round(rec["row_bytes"] / rec["ms"] / 1e6, 2)
        except Exception as e:  # an out-of-memory or a lowering error: recorded, the rest still runs
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        into[name] = rec
        log(f"{name}: {rec.get('ms', rec.get('error'))} ms (first call {rec.get('first_call_s')} s)")
        self.save()
        return rec


@jax.jit
def _close(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.max(d), jnp.sum(d > ATOL + RTOL * jnp.abs(y.astype(jnp.float32)))


def close(x: jax.Array, y: jax.Array) -> dict:
    """max |x - y| and the elements beyond rtol/atol (y the reference)."""
    if x.shape != y.shape:
        return {"shapes": [list(x.shape), list(y.shape)], "within": False}
    d, bad = _close(x, y)
    return {"max_abs_diff": float(d), "beyond_tolerance": int(bad), "within": int(bad) == 0}


# -- the programs ------------------------------------------------------------------------------------
def tpurec_pieces(num_rows: int, device_batch: int) -> dict[str, Callable[..., Any]]:
    """update_jax.row_gradients' one-SparseCore path (`_merge_in_slot_order`) cut into programs, then
    the optimizer: the same operations, each jitted alone on the previous one's outputs."""
    kw = dict(num_rows=num_rows, device_batch_size=device_batch, num_sc=NUM_SC, num_partitions=NUM_SC * DEVICES)

    def decode(rp, emb, smp, gns):
        return tuple(csr_jax.decode(rp, emb, smp, gns, **kw))

    def grad_rows(samples, gains, valid, grad):
        return jnp.where(valid[:, None], grad[jnp.where(valid, samples, 0)] * gains[:, None], 0.0)

    def segment_ids(rows, valid):
        before = jnp.concatenate([jnp.full(1, -1, jnp.int32), rows[:-1]])
        starts = valid & (rows != before)
        return starts, jnp.cumsum(starts.astype(jnp.int32)) - 1

    def segment_sum(contributions, segment, k):  # k: the distinct-rows bound (update_jax._distinct)
        return jax.ops.segment_sum(contributions, segment, num_segments=k, indices_are_sorted=True)

    def distinct_rows(rows, starts, segment, k):
        return jnp.full(k, num_rows, jnp.int32).at[jnp.where(starts, segment, k)].set(rows, mode="drop")

    fns: dict[str, Callable[..., Any]] = dict(decode=decode, grad_rows=grad_rows, segment_ids=segment_ids)
    jitted = {k: jax.jit(f) for k, f in fns.items()}
    jitted.update(
        segment_sum=jax.jit(segment_sum, static_argnums=2),
        distinct_rows=jax.jit(distinct_rows, static_argnums=3),
        apply=jax.jit(update_jax.adagrad),
    )
    return jitted


def jax_programs(hots: list[int], batch: int, dim: int, lr: float, eps: float) -> tuple[Callable, Callable]:
    """The contender's update and lookup on its own tables (one array each), as train_step runs them."""

    def update(tables, accs, ids, grads):
        out = []
        for t, acc, i, g, h in zip(tables, accs, ids, grads, hots):
            rows = jnp.broadcast_to(g[:, None, :], (batch, h, dim)).reshape(-1, dim)  # d(sum over hots)/d(rows)
            out.append(rowwise_adagrad(t, acc, i, rows, lr, eps))
        return [t for t, _ in out], [acc for _, acc in out]

    def take_sum(tables, ids):
        return [jnp.take(t, i.reshape(batch, h), axis=0).sum(axis=1) for t, i, h in zip(tables, ids, hots)]

    return jax.jit(update, donate_argnums=(0, 1)), jax.jit(take_sum)


def jax_pieces(
    hots: list[int], rows: list[int], batch: int, dim: int, lr: float, eps: float
) -> dict[str, Callable[..., Any]]:
    """`rowwise_adagrad`'s three steps as programs of their own (its lines, per table): the distinct ids
    (`jnp.unique`, static size), the segment sum of the gradient rows, the gather-update-scatter."""
    sizes = [min(batch * h, r) for h, r in zip(hots, rows)]

    def unique(ids):
        return [jnp.unique(i, size=n, fill_value=r, return_inverse=True) for i, n, r in zip(ids, sizes, rows)]

    def segment_sum(grads, inverses):
        out = []
        for g, inv, h, n in zip(grads, inverses, hots, sizes):
            rows_g = jnp.broadcast_to(g[:, None, :], (batch, h, dim)).reshape(-1, dim)
            out.append(jax.ops.segment_sum(rows_g, inv.reshape(-1), num_segments=n))
        return out

    def apply(tables, accs, uniques, sums):
        new_t, new_a = [], []
        for t, acc, u, g in zip(tables, accs, uniques, sums):
            acc_u = acc.at[u].get(mode="fill", fill_value=0.0) + jnp.mean(g * g, axis=1)
            step = (-lr / (jnp.sqrt(acc_u) + eps))[:, None] * g
            new_t.append(t.at[u].add(step, mode="drop"))
            new_a.append(acc.at[u].set(acc_u, mode="drop"))
        return new_t, new_a

    return dict(
        jax_unique=jax.jit(unique),
        jax_segment_sum=jax.jit(segment_sum),
        jax_apply=jax.jit(apply, donate_argnums=(0, 1)),
    )


# -- the probe ---------------------------------------------------------------------------------------
@dataclass
class Setup:
    """The stack, its batch and every program, shared by the cells."""

    a: argparse.Namespace
    lay: StackLayout
    hots: list[int]
    rows: list[int]  # per table
    entries: tuple[torch.Tensor, ...]
    demand: tuple[int, int]  # the batch's fullest partition: (entries after merging, unique ids)
    n_ids: int
    distinct: int
    table0: jax.Array
    acc0: jax.Array
    grad: jax.Array  # [tables x batch, dim]: the stack's activations gradient, small integers
    j_ids: list[jax.Array]  # the contender's ids per table, [batch x hots] sample-major
    j_grads: list[jax.Array]  # the contender's pooled gradient per table, [batch, dim]
    progs: dict[str, Callable[..., Any]] = field(default_factory=dict)

    @property
    def layout(self) -> tuple[int, int, int]:
        """The lookup's (device batch, SparseCores, partitions); an update's adds its unique limit."""
        return (len(self.rows) * self.a.batch, NUM_SC, self.lay.num_partitions)

    def update_layout(self, csr: SparseCoreInput) -> tuple[int, int, int, int]:
        return (*self.layout, csr.max_unique_ids_per_partition)

    @property
    def scalars(self) -> tuple[jax.Array, jax.Array]:
        return jnp.float32(self.a.lr), jnp.float32(self.a.eps)

    @property
    def useful_bytes(self) -> int:
        """Rows an update must move: each distinct row read and written once."""
        return 2 * self.distinct * self.lay.storage_dim * 4

    def j_tables(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Fresh copies of the contender's tables (the stack's slices) and zero accumulators."""
        offs = [t.offset for t in self.lay.tables]
        return (
            [self.table0[o : o + r] + 0 for o, r in zip(offs, self.rows)],
            [jnp.zeros((r,), jnp.float32) for r in self.rows],
        )


def setup(a: argparse.Namespace, doc: dict) -> Setup:
    features = a.features.split(",")
    if a.hots:
        hots = [int(h) for h in a.hots.split(",")]
    else:
        hots = [MLPERF_DCNV2_MULTI_HOT[FEATURE_NAMES.index(f)] for f in features]
        hots = [max(1, h // 10) for h in hots] if a.cpu else hots
    if len(hots) != len(features):
        raise SystemExit(f"--hots: {len(hots)} values for {len(features)} features")
    names = [f"t_{f}" for f in features]
    rows = [a.rows // len(features)] * len(features)
    rows[-1] += a.rows - sum(rows)
    lay = stack_layout(names, rows, a.dim)
    R, D, B, nf = lay.total_rows, lay.storage_dim, a.batch, len(features)
    doc["shape"] = {
        "tables": names,
        "table_rows": rows,
        "offsets": [t.offset for t in lay.tables],
        "stack_rows": R,
        "stack_gib": round(R * D * 4 / 2**30, 3),
        "dim": D,
        "batch": B,
        "hots": hots,
        "zipf": a.zipf,
        "num_sc": NUM_SC,
        "num_partitions": lay.num_partitions,
        "lr": a.lr,
        "eps": a.eps,
    }
    log(f"device {doc['device']}, jax {jax.__version__}; stack {R} x {D}, tables {names} hots {hots}, batch {B}")
    t = time.perf_counter()
    ids = table_ids(a, features, rows, hots)
    entries = stack_entries(lay, ids, B)
    _, own = preprocess(*entries, device_batch_size=nf * B, num_sc_per_device=NUM_SC, global_device_count=DEVICES)
    demand = (own.max_ids_per_partition, own.max_unique_ids_per_partition)
    n_ids, distinct = int(entries[0].numel()), int(torch.unique(entries[0]).numel())  # P = 1: id = stacked row
    doc.update(ids=n_ids, entries_after_merge=demand[0], distinct_rows=distinct)
    doc["host_prep_s"] = round(time.perf_counter() - t, 2)
    log(f"{n_ids} ids, {demand[0]} entries after merging (id, sample), {distinct} distinct rows")
    grad = jax.random.randint(jax.random.key(a.seed + 1), (nf * B, D), 1, 5).astype(jnp.float32)
    s = Setup(
        a=a,
        lay=lay,
        hots=hots,
        rows=rows,
        entries=entries,
        demand=demand,
        n_ids=n_ids,
        distinct=distinct,
        table0=jax.random.normal(jax.random.key(a.seed), (R, D), jnp.float32),
        acc0=jnp.zeros((R,), jnp.float32),
        grad=grad,
        j_ids=[jnp.asarray(x.reshape(-1).astype(np.int32)) for x in ids],
        j_grads=[grad[k * B : (k + 1) * B] for k in range(nf)],  # feature k's samples (stacked_samples)
    )
    s.progs = dict(
        update=jax.jit(tpu_bridge.tc_adagrad, static_argnums=(9, 10, 11, 12)),
        update_donated=jax.jit(tpu_bridge.tc_adagrad, static_argnums=(9, 10, 11, 12), donate_argnums=(4, 5)),
        update_rows=jax.jit(tpu_bridge.tc_adagrad_rows, static_argnums=(9, 10, 11, 12)),
        lookup=jax.jit(tpu_bridge.tc_lookup, static_argnums=(5, 6, 7)),
        row_gradients=jax.jit(
            lambda rp, emb, smp, gns, t, g, lay: tpu_bridge._row_gradients(rp, emb, smp, gns, t, g, lay)[:2],
            static_argnums=6,
        ),
        copy=jax.jit(lambda x, y: (x + 0, y + 0)),
        **tpurec_pieces(R, nf * B),
    )
    s.progs["jax_update"], s.progs["jax_take_sum"] = jax_programs(hots, B, D, a.lr, a.eps)
    s.progs.update(jax_pieces(hots, rows, B, D, a.lr, a.eps))
    return s


def cell(s: Setup, clock: Clock, factor: float) -> dict:
    """One limit factor: tpurec's update program, donated too, its pieces, the lookup."""
    csr = csr_at(s.entries, s.layout[0], factor, s.a.unique_factor, s.demand)
    head = device_csr(csr)
    slots = int(csr.embedding_ids.numel())
    ulay = s.update_layout(csr)
    bound = update_jax.distinct_rows_bound(NUM_SC, s.lay.num_partitions, csr.max_unique_ids_per_partition)
    out: dict[str, Any] = {
        "limit_factor": factor,
        "max_ids_per_partition": csr.max_ids_per_partition,
        "max_unique_ids_per_partition": csr.max_unique_ids_per_partition,
        "slots": slots,
        "rows_the_optimizer_touches": min(slots, bound),
        "ids": s.n_ids,
        "entries": s.demand[0],
        "distinct_rows": s.distinct,
        "programs": {},
    }
    clock.doc["cells"].append(out)
    log(f"cell {factor}x: {slots} slots, the optimizer over {min(slots, bound)} rows")
    progs, p, t0, a0, g, layout = out["programs"], s.progs, s.table0, s.acc0, s.grad, s.layout
    lr, eps = s.scalars
    common = {"slots": slots, "ids": s.n_ids, "distinct_rows": s.distinct}
    upd = {**common, "row_bytes": s.useful_bytes}
    clock.time(
        progs, "update_program", lambda: p["update"](*head, t0, a0, g, lr, eps, *ulay), {**upd, "donated": False}
    )
    clock.time(  # the default route since session 36: only the changed rows come back (index_copy_'d)
        progs,
        "update_program_rows",
        lambda: p["update_rows"](*head, t0, a0, g, lr, eps, *ulay),
        {**upd, "donated": False},
    )
    out["rows_route_vs_program"] = rows_route_check(p, head, t0, a0, g, lr, eps, ulay)
    state = [t0 + 0, a0 + 0]

    def donated_step() -> Any:
        state[:] = p["update_donated"](*head, *state, g, lr, eps, *ulay)
        return state

    clock.time(progs, "update_program_donated", donated_step, {**upd, "donated": True})
    del state[:]
    if not s.a.no_pieces:
        pieces(s, clock, head, out, common, ulay, min(slots, bound))
    out["pallas_pool"] = pallas_pool.fits(layout[0], s.lay.storage_dim, tpu_bridge._vmem_capacity())
    look = {**common, "row_bytes": s.demand[0] * s.lay.storage_dim * 4, "pallas_pool": out["pallas_pool"]}
    clock.time(progs, "lookup_program", lambda: p["lookup"](*head, t0, *layout), look)
    if "equal_work" not in clock.doc:
        clock.doc["equal_work"] = equal_work(s, head, ulay)
        clock.save()
        log(f"equal work: {json.dumps(clock.doc['equal_work'])}")
    return out


def rows_route_check(p: dict, head: tuple, t0: Any, a0: Any, g: Any, lr: Any, eps: Any, ulay: tuple) -> dict:
    """The rows route's rows and accumulator against the copy route's new table at those rows (the
    same arithmetic: 0.0 expected), and how many rows it returned."""
    new_t, new_a = p["update"](*head, t0, a0, g, lr, eps, *ulay)
    idx, rows, acc = p["update_rows"](*head, t0, a0, g, lr, eps, *ulay)
    return {
        "rows_returned": int(idx.shape[0]),
        "table_max_abs_diff": float(jnp.max(jnp.abs(new_t[idx] - rows))),
        "accumulator_max_abs_diff": float(jnp.max(jnp.abs(new_a[idx] - acc.reshape(new_a[idx].shape)))),
    }


def pieces(s: Setup, clock: Clock, head: tuple[jax.Array, ...], out: dict, common: dict, ulay: tuple, k: int) -> None:
    """The update program's pieces, each timed on the previous one's outputs; then chained end to end
    against the program (the same operations: bit for bit expected)."""
    progs, p, t0, a0, g = out["programs"], s.progs, s.table0, s.acc0, s.grad
    lr, eps = s.scalars
    m: dict[str, Any] = {}  # the intermediates, freed together below
    m["rows"], m["samples"], m["gains"], m["valid"] = p["decode"](*head)
    m["contrib"] = p["grad_rows"](m["samples"], m["gains"], m["valid"], g)
    m["starts"], m["segment"] = p["segment_ids"](m["rows"], m["valid"])
    m["sums"] = p["segment_sum"](m["contrib"], m["segment"], k)
    m["urows"] = p["distinct_rows"](m["rows"], m["starts"], m["segment"], k)
    slot_bytes = {**common, "row_bytes": 2 * out["slots"] * s.lay.storage_dim * 4}
    clock.time(progs, "decode", lambda: p["decode"](*head), dict(common))
    clock.time(progs, "grad_rows", lambda: p["grad_rows"](m["samples"], m["gains"], m["valid"], g), slot_bytes)
    clock.time(progs, "segment_ids", lambda: p["segment_ids"](m["rows"], m["valid"]), dict(common))
    clock.time(progs, "segment_sum", lambda: p["segment_sum"](m["contrib"], m["segment"], k), slot_bytes)
    urows = lambda: p["distinct_rows"](m["rows"], m["starts"], m["segment"], k)  # noqa: E731
    clock.time(progs, "distinct_rows", urows, dict(common))
    apply_rec = {**common, "row_bytes": s.useful_bytes, "donated": False}
    clock.time(progs, "apply", lambda: p["apply"](t0, a0, m["urows"], m["sums"], lr, eps), apply_rec)
    clock.time(progs, "row_gradients", lambda: p["row_gradients"](*head, t0, g, ulay), slot_bytes)
    timed = [progs[k].get("ms") for k in PIECES]
    if all(isinstance(v, float) for v in timed):
        out["pieces_sum_ms"] = round(sum(float(v) for v in timed), 4)
    # the slot-sized intermediates freed first (at 2x limits each is ~2 GB at the default shape)
    urows, sums = m["urows"], m["sums"]
    m.clear()
    try:
        got_t, got_a = p["apply"](t0, a0, urows, sums, lr, eps)
        del urows, sums
        want_t, want_a = p["update"](*head, t0, a0, g, lr, eps, *ulay)
        out["pieces_vs_program"] = {"table": close(got_t, want_t), "accumulator": close(got_a, want_a)}
    except Exception as ex:
        out["pieces_vs_program"] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}


def contender(s: Setup, clock: Clock) -> None:
    """The JAX contender's update (its state chained, donated) and lookup; a copy of the stack."""
    jc = clock.doc["jax_contender"]
    p = s.progs
    common: dict[str, Any] = {"ids": s.n_ids, "distinct_rows": s.distinct}
    common["unique_size"] = [min(s.a.batch * h, r) for h, r in zip(s.hots, s.rows)]
    state = list(s.j_tables())

    def step() -> Any:
        state[:] = p["jax_update"](*state, s.j_ids, s.j_grads)
        return state

    clock.time(jc, "jax_update", step, {**common, "row_bytes": s.useful_bytes, "donated": True})
    look = {**common, "row_bytes": s.n_ids * s.lay.storage_dim * 4}
    clock.time(jc, "jax_take_sum", lambda: p["jax_take_sum"](state[0], s.j_ids), look)
    if not s.a.no_pieces:
        uniq = p["jax_unique"](s.j_ids)
        uniques, inverses = [u for u, _ in uniq], [i for _, i in uniq]
        sums = p["jax_segment_sum"](s.j_grads, inverses)
        clock.time(jc, "jax_unique", lambda: p["jax_unique"](s.j_ids), dict(common))
        seg = {**common, "row_bytes": 2 * s.n_ids * s.lay.storage_dim * 4}
        clock.time(jc, "jax_segment_sum", lambda: p["jax_segment_sum"](s.j_grads, inverses), seg)

        def apply() -> Any:
            state[:] = p["jax_apply"](*state, uniques, sums)
            return state

        clock.time(jc, "jax_apply", apply, {**common, "row_bytes": s.useful_bytes, "donated": True})
        timed = [jc[k].get("ms") for k in ("jax_unique", "jax_segment_sum", "jax_apply")]
        if all(isinstance(v, float) for v in timed):
            clock.doc["jax_pieces_sum_ms"] = round(sum(float(v) for v in timed), 4)
        del uniq, uniques, inverses, sums
    del state[:]
    copy = {"row_bytes": 2 * s.table0.size * 4}
    clock.time(jc, "table_copy", lambda: p["copy"](s.table0, s.acc0), copy)


def equal_work(s: Setup, head: tuple[jax.Array, ...], ulay: tuple) -> dict:
    """tpurec's update and lookup against the contender's after one step from the same state: every row
    of the stack (the contender's tables put back at their offsets into the initial stack)."""
    p, t0, a0 = s.progs, s.table0, s.acc0
    lr, eps = s.scalars
    offs = [t.offset for t in s.lay.tables]
    try:
        ours_t, ours_a = p["update"](*head, t0, a0, s.grad, lr, eps, *ulay)
        jt, ja = p["jax_update"](*s.j_tables(), s.j_ids, s.j_grads)
        theirs_t, theirs_a = t0, a0
        for o, r, t, acc in zip(offs, s.rows, jt, ja):
            theirs_t = theirs_t.at[o : o + r].set(t)
            theirs_a = theirs_a.at[o : o + r].set(acc)
        del jt, ja
        out: dict[str, Any] = {"rtol": RTOL, "atol": ATOL}
        out["table"], out["accumulator"] = close(ours_t, theirs_t), close(ours_a, theirs_a)
        out["rows_changed_tpurec"] = int(jnp.sum(jnp.any(ours_t != t0, axis=1)))
        out["rows_changed_jax"] = int(jnp.sum(jnp.any(theirs_t != t0, axis=1)))
        del ours_t, ours_a, theirs_t, theirs_a
        pooled = p["lookup"](*head, t0, *s.layout)
        theirs = p["jax_take_sum"]([t0[o : o + r] for o, r in zip(offs, s.rows)], s.j_ids)
        out["lookup"] = close(pooled, jnp.concatenate(theirs))
        out["passed"] = all(out[k]["within"] for k in ("table", "accumulator", "lookup"))
        return out
    except Exception as ex:
        return {"error": f"{type(ex).__name__}: {str(ex)[:400]}", "passed": False}


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    doc: dict[str, Any] = {
        "probe": "tpu_probe_update",
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform,
        "timing": {"warmup": a.warmup, "reps": a.reps, "stat": "median ms of reps, each waited for"},
        "notes": NOTES,
        "cells": [],
        "jax_contender": {},
    }
    clock = Clock(a, doc)
    s = setup(a, doc)
    for i, factor in enumerate(float(f) for f in a.limits.split(",")):
        cell(s, clock, factor)
        if i == 0:  # equal work checked in the first cell: the contender's timing may follow
            contender(s, clock)
    doc["elapsed_s"] = round(time.monotonic() - clock.t0, 1)
    clock.save()
    text = json.dumps(doc, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return doc


NOTES = {
    "update_program": "tpu_bridge.tc_adagrad jitted, nothing donated (as TorchTPU's jax_op runs it; the bridge "
    "then copies table and accumulator back into the module's storage: about jax_contender.table_copy)",
    "first_call_s": "the first call (compile and run); a piece's inputs were made by an untimed call before, "
    "so its first call is a run only",
    "row_bytes": "update/apply/jax_update: distinct rows x dim x 4 x 2 (each distinct row read and written once); "
    "slot pieces: slots x dim x 4 x 2 (a row read and one written per slot); lookups: entries (tpurec) or ids "
    "(jnp.take) x dim x 4; GBps_rows = row_bytes / median",
    "jax_pieces": "jax_unique + jax_segment_sum + jax_apply: rowwise_adagrad's lines as three programs "
    "(jax_pieces_sum_ms); jax_segment_sum's row_bytes: ids x dim x 4 x 2",
    "pieces_sum_ms": "decode + grad_rows + segment_ids + segment_sum + distinct_rows + apply, each alone",
}


if __name__ == "__main__":
    main()
