"""`tpurec bench host-tier`: a table on the host tier against the same table resident, on the CPU.

One EmbeddingBagCollection table (ROWS x DIM, row-wise Adagrad) and a linear head, trained on the same
batches by every contender: `resident` (all rows in the kernel) and `host-<load factor>` (the table
in host memory behind a cache of that share of its rows, LRU or LFU). Ids are Zipf(1.05) over the
rows (hot rows scattered by a fixed permutation) or uniform. Per round the contenders run in a random
order, each STEPS steps; reported: samples/s, the ratio to `resident` per round (median, worst), the
cache's hit rate after the first round (distinct rows per batch found cached) and evictions; each
round trains on batches of its own. Equal work: every contender's
losses equal the resident one's bit for bit over the first round (the tier is exact). The figures are
the host's own copies (host memory to host memory): the chip's link is not in them (issue 60 asks
for those on a TPU); `--quick` is CI's smoke run.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tpurec import strict_json
from tpurec.bench.rounds import fresh_seed, load_average, ratio_summary

FULL = {"rows": 200_000, "dim": 64, "batch": 512, "pooling": 8, "steps": 20, "rounds": 3}  # docs/bench.md
QUICK = {"rows": 10_000, "dim": 16, "batch": 64, "pooling": 4, "steps": 4, "rounds": 3}
ZIPF_EXPONENT = 1.05  # issue 60's id law


def _batches(shape: dict, dist: str, seed: int) -> list[tuple[Any, Any]]:
    """(ids KJT, labels) per step: ids of one feature, `pooling` per sample."""
    import numpy as np
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = np.random.default_rng(seed)
    rows, n = shape["rows"], shape["batch"] * shape["pooling"]
    if dist == "zipf":
        p = 1.0 / np.arange(1, rows + 1) ** ZIPF_EXPONENT
        hot = g.permutation(rows)  # rank k -> a row: hot rows spread over the table
        draw = lambda: hot[g.choice(rows, n, p=p / p.sum())]  # noqa: E731
    else:
        draw = lambda: g.integers(0, rows, n)  # noqa: E731
    out = []
    for _ in range(shape["steps"]):
        kjt = KeyedJaggedTensor(
            keys=["f"],
            values=torch.from_numpy(draw().astype(np.int64)),
            lengths=torch.full((shape["batch"],), shape["pooling"]),
        )
        out.append((kjt, torch.from_numpy(g.integers(0, 2, shape["batch"]).astype(np.float32))))
    return out


def _model(shape: dict, cache: Any) -> dict[str, Any]:
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    table = EmbeddingBagConfig(name="t", embedding_dim=shape["dim"], num_embeddings=shape["rows"], feature_names=["f"])
    torch.manual_seed(0)
    ebc = SparseCoreEmbeddingBagCollection(
        [table], RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8}, cache_params=None if cache is None else {"t": cache}
    )
    torch.manual_seed(1)
    head = torch.nn.Linear(shape["dim"], 1)
    return {"ebc": ebc, "head": head, "opt": torch.optim.SGD(head.parameters(), lr=0.05)}


def _train(m: dict[str, Any], data: list) -> list[float]:
    import torch

    losses = []
    for kjt, labels in data:
        logits = m["head"](m["ebc"](kjt).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        m["opt"].zero_grad()
        loss.backward()
        m["opt"].step()
        losses.append(float(loss.detach()))
    return losses


def _counters(m: dict[str, Any]) -> dict[str, Any] | None:
    counters = getattr(m["ebc"].kernel, "host_tier_counters", None)
    if counters is None:
        return None
    c = counters()["t"]
    return {"hits": c.hits, "misses": c.misses, "evictions": c.evictions}


def _steady(warm: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, Any] | None:
    """The counters after the first round (the cache warm), with their hit rate."""
    if warm is None or end is None:
        return None
    hits, misses = end["hits"] - warm["hits"], end["misses"] - warm["misses"]
    return {
        "hit_rate_after_round_1": round(hits / max(hits + misses, 1), 4),
        "hits": hits,
        "misses": misses,
        "evictions": end["evictions"] - warm["evictions"],
    }


def run_dist(shape: dict, dist: str, load_factors: list[float], algorithm: str, rng: random.Random) -> dict:
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    # each round its own batches, the same for every contender (a contender sees round 0, 1, ... in turn)
    data = [_batches(shape, dist, seed=rng.randrange(2**31)) for _ in range(shape["rounds"])]
    algo = CacheAlgorithm.LFU if algorithm == "lfu" else CacheAlgorithm.LRU
    caches = {"resident": None, **{f"host-{lf:g}": CacheParams(load_factor=lf, algorithm=algo) for lf in load_factors}}
    models = {name: _model(shape, cache) for name, cache in caches.items()}
    secs: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    warm: dict[str, dict[str, Any] | None] = {}
    for r in range(shape["rounds"]):
        order = list(models)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            losses[name] += _train(models[name], data[r])
            secs[name].append(time.perf_counter() - t0)
            if r == 0:
                warm[name] = _counters(models[name])  # the cold cache's first round, left out of the hit rate
    samples = shape["steps"] * shape["batch"]
    out: dict[str, Any] = {"dist": dist, "contenders": {}}
    for name, m in models.items():
        out["contenders"][name] = {
            "samples_per_s": round(samples / min(secs[name]), 1),
            "vs_resident": ratio_summary(secs[name], secs["resident"]),
            "losses_equal_resident": losses[name] == losses["resident"],
            "cache": _steady(warm[name], _counters(m)),
        }
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("host-tier", help="a table on the host tier vs resident, on the CPU (hit rate, samples/s)")
    p.add_argument(
        "--load-factors",
        default="0.05,0.1,0.2,0.5",
        help="cache sizes as shares of the rows (default 0.05,0.1,0.2,0.5)",
    )
    p.add_argument("--algorithm", choices=("lru", "lfu"), default="lru", help="eviction (default lru)")
    p.add_argument("--dists", default="zipf,uniform", help="id laws: zipf (exponent 1.05), uniform (default both)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CI's smoke run)")
    p.add_argument("--seed", type=int, default=None, help="order and data seed (default: fresh, reported)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tpurec.errors import UserError

    try:
        load_factors = [float(x) for x in args.load_factors.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--load-factors takes numbers like 0.1,0.2; got {args.load_factors!r}") from None
    if not load_factors or not all(0 < lf < 1 for lf in load_factors):
        raise UserError(f"--load-factors: shares of the rows in (0, 1); got {args.load_factors!r}")
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    if not dists or set(dists) - {"zipf", "uniform"}:
        raise UserError(f"--dists takes zipf, uniform; got {args.dists!r}")
    shape = QUICK if args.quick else FULL
    seed = fresh_seed() if args.seed is None else args.seed
    rng = random.Random(seed)
    before = load_average()
    results = [run_dist(shape, d, load_factors, args.algorithm, rng) for d in dists]
    doc = {
        "shape": shape,
        "algorithm": args.algorithm,
        "seed": seed,
        "load_average": {"before": before, "after": load_average()},
        "results": results,
    }
    print(strict_json.dumps(doc, indent=1))
    return 0
