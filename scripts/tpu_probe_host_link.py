"""Chip probe 11: where the host tier's row copies go on a TPU, piece by piece, through TorchTPU.

`tpurec bench host-tier --device tpu` (docs/results.md, session 32) spent 92 ms a step loading 23,068
missed rows and 84 ms completing their evictions' write-backs (a 4M x 128 f32 table with row-wise
Adagrad, a 20% cache): ~12 MB each way, ~130-140 MB/s. This probe tells the host link from the rest:

- `h2d_<MB>` / `d2h_<MB>`: one float32 tensor of that size moved host->device (`.to(device)`, then
  drained) and device->host (`.cpu()`), the raw transfer rate at the sizes a chunk has;
- `host_gather`: the load's host side, as `device_copies._load_chunk` does it (the rows and the state
  gathered from the host table with the padded row list into one packed [bucket, dim + 1] tensor);
- `host_scatter`: the write-back's host side (the packed rows into the host table, `index_copy_`);
- `device_scatter` / `device_gather`: the cache's side (`index_copy_` of the packed rows into a
  [cache rows, dim] table on the device; `index_select` of as many slots), each drained;
- `load` / `write_back`: `device_copies.load` and `write_back` whole (what the table tier calls).
- on a device only, with host memory from the accelerator's pinned allocator (`pin_memory()`:
  TorchTPU's `TpuPinnedAllocator`): `h2d_pinned_<MB>` (`.to(device)`), `h2d_pinned_async_<MB>`
  (`non_blocking=True`, then drained), `d2h_pinned_<MB>` (`copy_(non_blocking=True)` into a pinned
  tensor, then `torch.accelerator.synchronize()`), and `load_pinned` / `write_back_pinned` (`load` and
  `write_back` with TPUREC_HOST_TIER_PINNED=1: the rows staged in kept pinned buffers, the write-back's
  copy asynchronous until its event, device_copies.py);
- on a device only, TorchTPU's batched transfer API (`batch_*`, `batch_transfers` below): rows in one
  range and in runs of 16 into scattered slots, each direction, whether they arrive where expected;
  and JAX's `device_put` of the raw sizes and DLPack into torch (`jax_*`, `jax_transfers`).

Median of `--reps` after one untimed run, ms, and MB/s of the rows moved. JSON on stdout (progress on
stderr; the document so far in $OUT/link_partial.json after each piece when OUT is set). `--device cpu`
runs it all on the CPU (a smoke run: the copies are then host to host).
Usage: python3 scripts/tpu_probe_host_link.py [--device tpu|cpu] [--rows 4000000] [--cache-rows 800000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tpurec.embedding.host_tier import device_copies


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--device", choices=("tpu", "cpu"), default="tpu")
    p.add_argument("--rows", type=int, default=4_000_000, help="host table rows")
    p.add_argument("--cache-rows", type=int, default=800_000, help="the cache's rows on the device")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n", type=int, default=23_068, help="rows a step loads (and writes back)")
    p.add_argument("--sizes-mb", default="1,12,64", help="raw transfer sizes, MB")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drain(t: torch.Tensor) -> None:
    """Wait for the device: one element read to the host (the op that wrote `t` is done)."""
    t.reshape(-1)[:1].cpu()


class Clock:
    def __init__(self, reps: int, doc: dict) -> None:
        self.reps, self.doc = reps, doc

    def time(self, name: str, fn: Callable[[], Any], row_bytes: int | None = None) -> None:
        """fn once untimed, then `reps` times; its median in ms (and MB/s of `row_bytes`)."""
        try:
            fn()
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            # Four significant figures, not three decimals: a sub-microsecond CPU piece is not 0.0 ms.
            rec: dict[str, Any] = {"ms": float(f"{ms:.4g}"), "min_ms": float(f"{min(times):.4g}")}
            if row_bytes:
                rec["bytes"], rec["MBps"] = row_bytes, round(row_bytes / ms / 1e3, 1)
            log(f"{name}: {rec}")
        except Exception as ex:  # a piece that fails is recorded; the others still run
            rec = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
            log(f"{name}: {rec['error']}")
        self.doc["pieces"][name] = rec
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "link_partial.json"), "w") as f:
                json.dump(self.doc, f, indent=1)


def pinned_transfers(clock: Clock, host: torch.Tensor, on_dev: torch.Tensor, label: str) -> None:
    """The raw transfers of `host`'s size from and into pinned host memory (module docstring)."""
    dev, nbytes = on_dev.device, host.numel() * 4
    try:
        pinned, back = host.pin_memory(), torch.empty_like(host).pin_memory()
    except RuntimeError as ex:
        clock.doc["pieces"][f"h2d_pinned_{label}"] = {"error": f"pin_memory: {str(ex)[:300]}"}
        return
    clock.doc.setdefault("is_pinned", pinned.is_pinned())
    clock.time(f"h2d_pinned_{label}", lambda: drain(pinned.to(dev)), nbytes)
    clock.time(f"h2d_pinned_async_{label}", lambda: drain(pinned.to(dev, non_blocking=True)), nbytes)

    def d2h() -> None:
        back.copy_(on_dev, non_blocking=True)
        torch.accelerator.synchronize()

    clock.time(f"d2h_pinned_{label}", d2h, nbytes)


def batch_transfers(clock: Clock, dev: torch.device, n: int, dim: int, cache_rows: int, seed: int) -> None:
    """TorchTPU's batched transfer (`host_tier/batch_transfer.py`, a private API read from the wheel):
    `batch_h2d_one` / `batch_d2h_one` move n rows as one range (sync; `_async`: the future's wait),
    `batch_h2d_runs` / `batch_d2h_runs` as runs of 16 rows into scattered cache slots (what a load
    into free slots would be without a scatter program); each piece's `equal` says whether the rows
    arrived where the reading in batch_transfer.py says they go."""
    from tpurec.embedding.host_tier import batch_transfer as bt

    host, back = torch.rand(n, dim), torch.zeros(n, dim)
    cache = torch.zeros(cache_rows, dim, device=dev)
    nbytes, run = n * dim * 4, 16
    runs = n // run
    starts = np.sort(np.random.default_rng(seed).choice(cache_rows // run, runs, replace=False)) * run
    src_off, dst_off, sizes = [i * run for i in range(runs)], [int(x) for x in starts], [run] * runs
    tensors = {"src": [host] * runs, "dst": [cache] * runs}

    def verdict(name: str, ok: Callable[[], bool]) -> None:
        rec = clock.doc["pieces"].get(name, {})
        if "error" not in rec:
            try:
                rec["equal"] = bool(ok())
            except Exception as ex:
                rec["equal_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"

    def arrived() -> bool:
        return torch.equal(cache[:n].cpu(), host)

    def arrived_runs() -> bool:
        got = cache.cpu()
        return all(torch.equal(got[d : d + run], host[s : s + run]) for s, d in zip(src_off, dst_off))

    clock.time("batch_h2d_one", lambda: drain(_then(bt.h2d([host], [cache], [0], [0], [n]), cache)), nbytes)
    verdict("batch_h2d_one", arrived)
    cache.zero_()
    clock.time("batch_h2d_one_async", lambda: _waited(bt.h2d([host], [cache], [0], [0], [n], wait=False)), nbytes)
    verdict("batch_h2d_one_async", arrived)
    clock.time("batch_d2h_one", lambda: bt.d2h([cache], [back], [0], [0], [n]), nbytes)
    verdict("batch_d2h_one", lambda: torch.equal(back, cache[:n].cpu()))
    cache.zero_()
    runs_bytes = runs * run * dim * 4
    h2d_runs = lambda: bt.h2d(tensors["src"], tensors["dst"], src_off, dst_off, sizes)  # noqa: E731
    clock.time("batch_h2d_runs", lambda: drain(_then(h2d_runs(), cache)), runs_bytes)
    verdict("batch_h2d_runs", arrived_runs)
    back.zero_()
    d2h_runs = lambda: bt.d2h(tensors["dst"], [back] * runs, dst_off, src_off, sizes)  # noqa: E731
    clock.time("batch_d2h_runs", d2h_runs, runs_bytes)
    verdict("batch_d2h_runs", lambda: torch.equal(back[: runs * run], host[: runs * run]))


def jax_transfers(clock: Clock, sizes_mb: list[float], torch_device: torch.device) -> None:
    """The same bytes through JAX in this process (TorchTPU runs on JAX's PJRT client): `jax_put_<MB>`
    (`jax.device_put` of a numpy array, waited for) and `jax_to_torch_<MB>` (that array handed to torch by
    DLPack, `torch.from_dlpack`: a device tensor without a copy, if TorchTPU takes it; `equal`, `device`),
    and `torch_to_jax_d2h_<MB>` (a torch device tensor read by JAX through DLPack into numpy): whether
    faster host<->device paths exist for the inputs, the host tier's rows and its write-backs."""
    import jax

    dev = jax.devices()[0]
    for mb in sizes_mb:
        host = np.random.default_rng(0).random(int(mb * 2**20) // 4, dtype=np.float32)
        nbytes = host.nbytes
        clock.time(f"jax_put_{mb:g}MB", lambda h=host: jax.device_put(h, dev).block_until_ready(), nbytes)
        put = jax.device_put(host, dev).block_until_ready()
        name = f"jax_to_torch_{mb:g}MB"
        clock.time(name, lambda p=put: drain(torch.from_dlpack(p)), nbytes)
        rec = clock.doc["pieces"].get(name, {})
        if "error" not in rec:
            try:
                t = torch.from_dlpack(put)
                rec["device"], rec["equal"] = str(t.device), bool(np.array_equal(t.cpu().numpy(), host))
            except Exception as ex:
                rec["equal_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        # the other way, for the write-backs: a torch tensor read by JAX (DLPack) to the host
        on_dev = torch.from_numpy(host).to(torch_device)
        name = f"torch_to_jax_d2h_{mb:g}MB"
        clock.time(name, lambda t=on_dev: np.asarray(jax.dlpack.from_dlpack(t)), nbytes)
        rec = clock.doc["pieces"].get(name, {})
        if "error" not in rec:
            rec["equal"] = bool(np.array_equal(np.asarray(jax.dlpack.from_dlpack(on_dev)), host))


def _then(_: Any, t: torch.Tensor) -> torch.Tensor:
    return t


def _waited(future: Any) -> None:
    future.wait()


def device_of(name: str) -> torch.device:
    from tpurec.runtime.device import resolve_device  # through tpurec's loading rules, also for "cpu"

    return resolve_device(name)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    dev = device_of(a.device)
    doc: dict[str, Any] = {"probe": "tpu_probe_host_link", "device": str(dev), "torch": torch.__version__}
    doc["shape"] = {k: getattr(a, k) for k in ("rows", "cache_rows", "dim", "n", "reps")}
    doc["pieces"] = {}
    clock = Clock(a.reps, doc)
    for mb in (float(x) for x in a.sizes_mb.split(",")):
        host = torch.rand(int(mb * 2**20) // 4)
        on_dev = host.to(dev)
        clock.time(f"h2d_{mb:g}MB", lambda h=host: drain(h.to(dev)), host.numel() * 4)
        clock.time(f"d2h_{mb:g}MB", lambda d=on_dev: d.cpu(), host.numel() * 4)
        if dev.type != "cpu":  # pinning needs an accelerator's allocator
            pinned_transfers(clock, host, on_dev, f"{mb:g}MB")
        del host, on_dev
    gen = np.random.default_rng(a.seed)
    table, acc = torch.rand(a.rows, a.dim), torch.rand(a.rows)
    cache, cache_acc = torch.zeros(a.cache_rows, a.dim, device=dev), torch.zeros(a.cache_rows, device=dev)
    rows = torch.from_numpy(np.sort(gen.choice(a.rows, a.n, replace=False)))
    slots = torch.from_numpy(np.sort(gen.choice(a.cache_rows, a.n, replace=False)))
    size = device_copies.bucket(min(a.n, device_copies.MAX_BUCKET), a.cache_rows)
    row_bytes = a.n * (a.dim + 1) * 4
    doc["shape"]["bucket"] = size

    def host_gather() -> torch.Tensor:
        padded = device_copies.pad(rows[: device_copies.MAX_BUCKET], size)
        packed = torch.empty(size, a.dim + 1)
        packed[:, : a.dim].copy_(table.index_select(0, padded))
        packed[:, a.dim :].copy_(acc.index_select(0, padded).reshape(size, 1))
        return packed

    packed = host_gather()
    clock.time("host_gather", host_gather, row_bytes)
    n = min(a.n, size)
    clock.time("host_scatter", lambda: table.index_copy_(0, rows[:n], packed[:n, : a.dim]), row_bytes)
    packed_dev = packed.to(dev)
    slots_dev = device_copies.pad(slots[:n], size).to(dev)
    scatter = lambda: drain(cache.index_copy_(0, slots_dev, packed_dev[:, : a.dim]))  # noqa: E731
    clock.time("device_scatter", scatter, row_bytes)
    clock.time("device_gather", lambda: drain(cache.index_select(0, slots_dev)), row_bytes)

    def load() -> None:
        device_copies.load([table, acc], rows, [cache, cache_acc], slots)
        drain(cache)

    clock.time("load", load, row_bytes)
    clock.time("write_back", lambda: device_copies.write_back([cache, cache_acc], slots, [table, acc], rows), row_bytes)
    if dev.type != "cpu":
        os.environ[device_copies.PINNED_ENV] = "1"  # the loads' rows staged in a kept pinned buffer
        clock.time("load_pinned", load, row_bytes)
        back = lambda: device_copies.write_back([cache, cache_acc], slots, [table, acc], rows)  # noqa: E731
        clock.time("write_back_pinned", back, row_bytes)  # started (async into pinned memory), completed
        os.environ.pop(device_copies.PINNED_ENV)
        doc["pinned_refused"] = device_copies._PINNED_REFUSED[:1]
        batch_transfers(clock, dev, min(a.n, a.cache_rows // 2), a.dim, a.cache_rows, a.seed)
        try:
            jax_transfers(clock, [float(x) for x in a.sizes_mb.split(",")], dev)
        except Exception as ex:  # JAX absent or refusing the device beside TorchTPU: said, not fatal
            doc["pieces"]["jax"] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
    text = json.dumps(doc, indent=1)
    print(text, flush=True)
    return doc


if __name__ == "__main__":
    main()
