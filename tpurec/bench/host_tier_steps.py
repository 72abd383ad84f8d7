"""The model, batches and timed steps of `tpurec bench host-tier` (tpurec/bench/host_tier.py).

One table (ROWS x DIM, row-wise Adagrad) in tpurec's SparseCoreEmbeddingBagCollection, resident or on
the host tier, and a linear head, both on the bench's device (the CPU, or a TPU: a chip or an emulated
one). A contender's steps are timed up to a drain of the device (one value of the head and one of the
table read to the host after the last step, as tpu_train_split._drain does), so a TPU's queued work is
in the time; the losses stay on the device until then.
"""

from __future__ import annotations

import time
from typing import Any

ZIPF_EXPONENT = 1.05  # issue 60's id law
# The seed of the Zipf law's hot-row permutation: one law for every batch set of a run (warm-up and each
# round), whatever their own seeds. Drawn from each set's seed, every round had hot rows of its own, and
# a cache warmed on one set met another: 47% hits at a 20% cache where an LRU over one law keeps 71%
# (session 32; docs/results.md).
HOT_ROWS_SEED = 20_260_601
WRITE_BACK_COPIES = "host tier rows"  # what device_copies.write_back counts its device->host copies under


def batches(shape: dict, dist: str, count: int, seed: int, device: Any) -> list[tuple[Any, Any]]:
    """`count` (ids KJT on the host, labels on `device`): ids of one feature, `pooling` per sample, Zipf
    (hot rows scattered over the table by a fixed permutation) or uniform."""
    import numpy as np
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = np.random.default_rng(seed)
    rows, n = shape["rows"], shape["batch"] * shape["pooling"]
    if dist == "zipf":
        cdf = np.cumsum(1.0 / np.arange(1, rows + 1) ** ZIPF_EXPONENT)
        cdf /= cdf[-1]
        hot = np.random.default_rng(HOT_ROWS_SEED).permutation(rows)  # rank k -> a row, the same in every set
        draw = lambda: hot[np.minimum(np.searchsorted(cdf, g.random(n), side="right"), rows - 1)]  # noqa: E731
    else:
        draw = lambda: g.integers(0, rows, n)  # noqa: E731
    out = []
    for _ in range(count):
        kjt = KeyedJaggedTensor(
            keys=["f"],
            values=torch.from_numpy(draw().astype(np.int64)),
            lengths=torch.full((shape["batch"],), shape["pooling"]),
        )
        labels = torch.from_numpy(g.integers(0, 2, shape["batch"]).astype(np.float32)).to(device)
        out.append((kjt, labels))
    return out


def model(shape: dict, cache: Any, device: Any) -> dict[str, Any]:
    """The table (values drawn from seed 0, whatever its tier) and the head (seed 1), on `device`."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    table = EmbeddingBagConfig(name="t", embedding_dim=shape["dim"], num_embeddings=shape["rows"], feature_names=["f"])
    torch.manual_seed(0)
    ebc = SparseCoreEmbeddingBagCollection(
        [table],
        RowWiseAdagrad,
        {"lr": 0.05, "eps": 1e-8},
        device=device,
        cache_params=None if cache is None else {"t": cache},
    )
    torch.manual_seed(1)
    head = torch.nn.Linear(shape["dim"], 1).to(device)
    return {"ebc": ebc, "head": head, "opt": torch.optim.SGD(head.parameters(), lr=0.05)}


def _drain(t: Any) -> None:
    """Wait for the device: one element of `t` read to the host (the last op that wrote it is done)."""
    t.detach().reshape(-1)[:1].cpu()


def train(m: dict[str, Any], data: list) -> tuple[list[float], float, int]:
    """One step per batch: (the losses, the seconds up to the device's drain, write-back copies made).

    The drain reads the head's weight (its SGD step is each step's last op) and the table's storage
    (the fused update's output) after the last step; the losses are read after the clock stops."""
    import torch

    from tpurec.runtime import host_copies

    copies = host_copies.counts().get(WRITE_BACK_COPIES, 0)
    losses = []
    t0 = time.perf_counter()
    for kjt, labels in data:
        logits = m["head"](m["ebc"](kjt).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        m["opt"].zero_grad()
        loss.backward()
        m["opt"].step()
        losses.append(loss.detach())
    _drain(m["head"].weight)
    _drain(m["ebc"].kernel.stack_weight(0))
    secs = time.perf_counter() - t0
    copies = host_copies.counts().get(WRITE_BACK_COPIES, 0) - copies
    return torch.stack(losses).cpu().tolist(), secs, copies


def counters(m: dict[str, Any]) -> dict[str, Any] | None:
    """The table's cache counters now (None: resident)."""
    found = getattr(m["ebc"].kernel, "host_tier_counters", None)
    if found is None:
        return None
    c = found()["t"]
    figures = {"hits": c.hits, "misses": c.misses, "evictions": c.evictions, "writebacks": c.writebacks}
    figures.update(id_hits=c.id_hits, id_misses=c.id_misses)
    return {**figures, "seconds": dict(c.seconds)}


def steady(warm: dict[str, Any] | None, end: dict[str, Any] | None, steps: int, copies: int) -> dict[str, Any] | None:
    """The counters after the first round (the cache warm) over its `steps` steps, with their hit rate,
    rows loaded and written back a step, `copies` (device->host write-back copies) a step and the host
    milliseconds a step in each part of the tier's id mapping (table_tier.PHASES)."""
    if warm is None or end is None:
        return None
    hits, misses = end["hits"] - warm["hits"], end["misses"] - warm["misses"]
    writebacks, per = end["writebacks"] - warm["writebacks"], max(steps, 1)
    id_hits, id_misses = end["id_hits"] - warm["id_hits"], end["id_misses"] - warm["id_misses"]
    return {
        "hit_rate_after_round_1": round(hits / max(hits + misses, 1), 4),
        "id_hit_rate_after_round_1": round(id_hits / max(id_hits + id_misses, 1), 4),
        "hits": hits,
        "misses": misses,
        "evictions": end["evictions"] - warm["evictions"],
        "rows_loaded_per_step": round(misses / per, 1),
        "rows_written_back_per_step": round(writebacks / per, 1),
        "write_back_copies_per_step": round(copies / per, 2),
        "host_ms_per_step": {
            k: round(1e3 * (v - warm["seconds"].get(k, 0.0)) / per, 3) for k, v in end["seconds"].items()
        },
    }


def max_rel_diff(got: list[float], want: list[float]) -> float:
    """The largest |got - want| / max(|want|, 1e-12) over the steps."""
    return max((abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True)), default=0.0)


def planner_hit_rates(shape: dict, data: list[list], load_factors: list[float], algorithm: str) -> dict[str, float]:
    """{contender: the hit rate the planner expects of its cache} (planner/hit_rate.py, steady state),
    from the hot-row curve of the ids in `data` (every batch the contenders train on), as `tpurec data
    stats` would measure it for `tpurec plan`."""
    import numpy as np

    from tpurec.embedding.host_tier.params import host_tier_params
    from tpurec.planner.hit_rate import estimate
    from tpurec.planner.hot_rows import curve_of

    ids = np.concatenate([kjt.values().cpu().numpy() for part in data for kjt, _ in part])
    samples = sum(kjt.stride() for part in data for kjt, _ in part)
    curve = curve_of(np.bincount(ids, minlength=shape["rows"]), samples)
    out = {}
    for lf in load_factors:
        cached = host_tier_params("t", shape["rows"], _cache(lf)).cached_rows
        out[f"host-{lf:g}"] = round(estimate(curve, cached, shape["batch"] * shape["pooling"], algorithm).hit_rate, 4)
    return out


def _cache(load_factor: float) -> Any:
    from torchrec.distributed.types import CacheParams

    return CacheParams(load_factor=load_factor)
