"""The table "Comparison with torchrec's default planner" in docs/planner.md: tpurec's plan and
torchrec's default plan for the same topology, pooling and batch, both scored with tpurec's cost
model (the calls of tests/planner/test_planner.py::test_no_worse_than_torchrec_default_planner).

    .venv/bin/python scripts/compare_planners.py
"""

from __future__ import annotations

import logging
import time

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import tpurec.planner.planners as P
from tpurec.data.catalog import get_table_set
from tpurec.dlrm.model import embedding_bag_configs
from tpurec.planner.report import build_report
from tpurec.planner.topology import GiB, make_topology

CASES = [
    ("mlperf-dcnv2", "v5p-128", "rowwise_adagrad", 256),
    ("mlperf-dcnv2", "v6e-256", "rowwise_adagrad", 256),
    ("mlperf-dcnv2", "v7x-64", "adam", 256),
    ("criteo-kaggle", "v6e-8", "adagrad", 512),
    ("mlperf-dcnv2", "2xv5p-128", "rowwise_adagrad", 256),
]


def main() -> None:
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    print(
        "| model, slice, optimizer | tpurec step (ms) | torchrec step (ms) | tpurec max HBM / cap (GiB) "
        "| torchrec max HBM (GiB) | planning time tpurec / torchrec |"
    )
    for model, name, opt, batch in CASES:
        tables = get_table_set(model).tables
        ebc = EmbeddingBagCollection(tables=embedding_bag_configs(get_table_set(model)), device=torch.device("meta"))
        cons = P.pooling_constraints({t.name: t.pooling_factor for t in tables})
        topo = make_topology(name)
        t0 = time.perf_counter()
        ours = P.plan(ebc, topo, batch_size=batch, constraints=cons, optimizer=opt)
        t1 = time.perf_counter()
        theirs = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False).plan(
            ebc, [EmbeddingBagCollectionSharder()]
        )
        t2 = time.perf_counter()
        cap = topo.spec.generation.hbm_bytes
        reserved = P.TpuStorageReservation().amount(ebc, batch, cap)
        reports = [
            build_report(p, tables, topo.spec, batch_size=batch, optimizer=opt, reserved=reserved)
            for p in (ours, theirs)
        ]
        hbm = [max(d["hbm_used_bytes"] for d in r["devices"]) / GiB for r in reports]
        print(
            f"| {model}, {name}, {opt} | {reports[0]['estimated_step_time_ms']:.3f} | "
            f"{reports[1]['estimated_step_time_ms']:.3f} | {hbm[0]:.2f} / {cap / GiB:.2f} | {hbm[1]:.2f} | "
            f"{t1 - t0:.1f} s / {t2 - t1:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
