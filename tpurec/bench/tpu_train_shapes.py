"""The workload of `tpurec bench tpu-train`: DLRM-DCNv2 at MLPerf shapes, tables capped to fit one chip.

Plain data (no jax, no torch), shared by both contenders and passed to the JAX worker process as JSON,
so the two train exactly the same shapes. The model is the `mlperf-dcnv2` config of
tpurec/dlrm/configs.py (its architecture is read from there, not copied); its 26 tables get the MLPerf
rows (tpurec/data/catalog.py) capped at `rows_cap` each, and its multi-hot sizes are MLPerf's (214 ids
per sample).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tpurec import strict_json
from tpurec.errors import UserError

# Rows per table, at most: 13,116,632 rows in all (of MLPerf's 204,184,588): at dim 128 in f32 with
# row-wise Adagrad's one f32 per row, 6.30 GiB of weights and state, under BUDGET_GIB and well under a
# v5e's 16 GiB of HBM (cloud.google.com/tpu/docs/v5e), leaving ~9 GiB for the step's activations (the
# gathered rows alone are 16,384 x 214 x 128 x 4 B = 1.8 GB at the default batch).
DEFAULT_ROWS_CAP = 2_000_000
# HBM of one v5e chip as JAX reports it usable: 15.7 GiB (docs/results.md, 2026-12-06, the first runs on
# the chip; 16 GB nominal: cloud.google.com/tpu/docs/v5e)
V5E_HBM_GIB = 15.7
BUDGET_GIB = 8.0  # weights + optimizer state of the tables, at most (the rest of the chip: activations)
CHIP_BATCH = 16_384  # per chip (the figure; MLPerf's global batch 65,536 is 8 x 8,192)
CPU_ROWS_CAP, CPU_BATCH = 300, 64  # `--cpu`: a smoke run, a few hundred rows per table
NUM_DENSE = 13  # Criteo's dense features (tpurec.data.catalog.NUM_DENSE)


@dataclass(frozen=True)
class Workload:
    rows: tuple[int, ...]  # per table, capped
    hots: tuple[int, ...]  # ids per sample of each table's feature
    dim: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    dcn_layers: int
    dcn_rank: int
    batch: int
    rows_cap: int
    embedding_lr: float
    dense_lr: float
    eps: float
    seed: int = 0
    num_dense: int = NUM_DENSE
    host_tier: tuple[str, ...] = ()  # tables kept in host memory by `tpurec train --host-tier` (names: table_names)

    def table_bytes(self, resident: bool = False) -> int:
        """Weights (f32) and row-wise Adagrad's state (one f32 per row) of all tables, or (`resident`)
        of those not on the host tier."""
        rows = sum(r for name, r in zip(table_names(self), self.rows) if not (resident and name in self.host_tier))
        return rows * (self.dim + 1) * 4

    def dense_params(self) -> int:
        """Parameters of the bottom MLP, the cross layers and the top MLP (Adagrad's state: as many)."""
        sizes = [self.num_dense, *self.dense_arch]
        n = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
        width = self.dim * (len(self.rows) + 1)  # the dense output and every table's pooled row
        n += self.dcn_layers * (2 * width * self.dcn_rank + width)
        top = [width, *self.over_arch]
        return n + sum(a * b + b for a, b in zip(top, top[1:]))

    def to_json(self) -> str:
        return strict_json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}
        return cls(**fields)

    def describe(self) -> dict:
        return {
            "model": "mlperf-dcnv2",
            "tables": len(self.rows),
            "rows_cap": self.rows_cap,
            "rows_total": sum(self.rows),
            "capped_tables": sum(1 for r, full in zip(self.rows, _mlperf_rows()) if r < full),
            "ids_per_sample": sum(self.hots),
            "dim": self.dim,
            "batch": self.batch,
            "table_gib": round(self.table_bytes() / 2**30, 3),
            "host_tier": list(self.host_tier),
            "resident_table_gib": round(self.table_bytes(resident=True) / 2**30, 3),
            "dense_params": self.dense_params(),
        }


def table_names(w: Workload) -> list[str]:
    """`tpurec train`'s table names for the workload's tables (t_ + the feature, C1..C26)."""
    return [f"t_C{i + 1}" for i in range(len(w.rows))]


def plan_tables(w: Workload) -> list[dict[str, Any]]:
    """The workload's tables as a `tpurec plan --tables` file holds them (planner/tables_file.py): its
    planner figure offline, for the chip's measured one (`bench tpu-train --tables-out`)."""
    return [
        {"name": name, "rows": rows, "dim": w.dim, "features": [name.removeprefix("t_")], "pooling_factor": hot}
        for name, rows, hot in zip(table_names(w), w.rows, w.hots, strict=True)
    ]


def _mlperf_rows() -> list[int]:
    from tpurec.data.catalog import MLPERF_DCNV2_ROWS

    return list(MLPERF_DCNV2_ROWS)


def workload(rows_cap: int, batch: int, seed: int = 0, host_tier: tuple[str, ...] = ()) -> Workload:
    """The mlperf-dcnv2 config's model over its tables capped at `rows_cap` rows each. `host_tier`:
    the tables (`t_C1`..`t_C26`, `tpurec train`'s names) kept in host memory (`--host-tier`), which
    the chip's budget does not count (nor their caches: `tpurec train`'s planner checks those)."""
    from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT
    from tpurec.dlrm.configs import embedding_dims, get_config

    if rows_cap < 2:  # tpurec's synthetic ids keep row 0 for "empty": a table needs another
        raise UserError(f"--rows-cap must be >= 2, got {rows_cap}")
    cfg = get_config("mlperf-dcnv2")
    w = Workload(
        rows=tuple(min(r, rows_cap) for r in _mlperf_rows()),
        hots=tuple(MLPERF_DCNV2_MULTI_HOT),
        dim=embedding_dims(cfg)[0],
        dense_arch=cfg.dense_arch,
        over_arch=cfg.over_arch,
        dcn_layers=cfg.dcn_num_layers,
        dcn_rank=cfg.dcn_low_rank_dim,
        batch=batch,
        rows_cap=rows_cap,
        embedding_lr=cfg.embedding_lr,
        dense_lr=cfg.dense_lr,
        eps=cfg.eps,
        seed=seed,
        host_tier=tuple(host_tier),
    )
    unknown = sorted(set(host_tier) - set(table_names(w)))
    if unknown:
        raise UserError(f"--host-tier names {', '.join(unknown)}: the tables are t_C1 .. t_C{len(w.rows)}")
    gib = w.table_bytes(resident=True) / 2**30
    if gib > BUDGET_GIB:
        raise UserError(
            f"--rows-cap {rows_cap:,}: the resident tables' weights and state take {gib:.2f} GiB, over the "
            f"{BUDGET_GIB:g} GiB this benchmark leaves them on a 16 GiB chip; lower --rows-cap, or keep tables in "
            f"host memory (--contenders tpurec --tpurec-args='--host-tier t_C1:0.2,...'; "
            f"default cap {DEFAULT_ROWS_CAP:,}: {workload(DEFAULT_ROWS_CAP, batch).table_bytes() / 2**30:.2f} GiB)"
        )
    return w
