"""What a training run reports: the plan it runs, its metrics file, and the final summary.

The Trainer calls these on rank 0; they only format and write, so they stay out of its loop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.dlrm.keep_best import summary_lines as best_summary_lines

if TYPE_CHECKING:
    from tpurec.data.catalog import TableSet, TableSpec
    from tpurec.dlrm.configs import DLRMConfig
    from tpurec.dlrm.tensorboard_log import TensorBoardLog


def plan_report(dmp: Any, cfg: DLRMConfig, table_set: TableSet, table_sizes: list[int], batch_size: int) -> dict:
    """The inspector's report of the plan the DMP is running (also the meta `tpurec plan show` reads).

    table_set is the config's catalog TableSet; table_sizes replace its sizes (those of the data)."""
    from tpurec.data.catalog import TableSpec

    tables = [
        TableSpec(t.name, t.feature, n, cfg.embedding_dim or t.embedding_dim, t.pooling_factor)
        for t, n in zip(table_set.tables, table_sizes)
    ]
    return plan_report_of(dmp, tables, batch_size, cfg.embedding_optimizer, cfg.name)


def plan_report_of(dmp: Any, tables: list[TableSpec], batch_size: int, optimizer: str, model: str) -> dict:
    """The report of the plan the DMP runs over `tables` (a `--model-module` model's own)."""
    from tpurec.planner.planners import DEFAULT_HEADROOM_FRACTION
    from tpurec.planner.report import build_report

    topo = dmp.topology
    # the planner's reservation (dense model, pooled embeddings, headroom, the TensorCore update's
    # stack copy and work), as `tpurec plan`'s report counts it; 0 where DMP could not say
    reserved = getattr(dmp, "planned_reserved_bytes", None) or 0
    return build_report(
        dmp.plan,
        tables,
        topo.spec,
        batch_size=batch_size,
        optimizer=optimizer,
        compute_device=topo.compute_device,
        reserved=reserved,
        headroom_fraction=DEFAULT_HEADROOM_FRACTION if reserved else 0.0,
        model=model,
    )


def plan_summary(report: dict) -> str:
    """The inspector's text without the per-table list (one line per sharding instead): one screen."""
    from collections import Counter

    from tpurec.planner.report_text import DEVICES_HEADER, format_text

    text = format_text(report, top=3).split("\n")
    kinds = Counter(f"{t['sharding_type']} ({t['compute_kernel']})" for t in report["tables"])
    head = text[:3]
    devices = text[text.index(DEVICES_HEADER) :]
    devices = devices[: devices.index("")] if "" in devices else devices
    return "\n".join(
        head
        + [
            f"tables: {len(report['tables'])}: "
            + ", ".join(f"{n} {k}" for k, n in kinds.items())
            + "  (per table: --save-plan P.json, then tpurec plan show P.json)"
        ]
        + devices
    )


class MetricsLog:
    """Rows of training / eval figures, kept here and written to a CSV or JSONL file (rank 0).

    The file is rewritten whole and atomically (tpurec.outputs.write_atomic): at once (its header),
    at every evaluation, at most every `FLUSH_EVERY_S` seconds between them, and by `flush()` at the
    end. A full disk thus never leaves a cut line, and a failed write does not stop training: it is
    kept in `failure` (one line naming the path), retried at the next write, and the trainer reports
    it after its result line.

    A resumed run (`resume_step`: the checkpoint's step) keeps the file's rows up to that step and
    drops the rest: rows a run logged after its last checkpoint are trained again, and the end-of-run
    rows (`id_demand`) are written anew, so the file has one row per step and a monotone curve."""

    FLUSH_EVERY_S = 2.0  # the whole file each time: bounded so long runs do not rewrite it per step

    FIELDS = [
        "kind",
        "step",
        "epoch",
        "samples",
        "seconds",
        "loss",
        "samples_per_s",
        "auc",
        "ne",
        "logloss",
        "accuracy",
        "rows",
        # kind "id_demand", one row per table at the end of a run (tpurec.dlrm.id_feedback.per_table)
        "table",
        "max_ids",
        "max_unique_ids",
        "multipass_batches",
        "dropped_ids",
        # --zch (tpurec.dlrm.zch): on train and eval rows, and one "zch_table" row per table at the end
        "zch_remapped_ids",
        "zch_hit_rate",
        "zch_evictions",
        "zch_occupancy",
    ]

    def __init__(
        self, path: str | None, resume_step: int | None = None, tensorboard: TensorBoardLog | None = None
    ) -> None:
        self.path = Path(path) if path else None
        self.tensorboard = tensorboard  # each row added also goes there (`--tensorboard`)
        self.records: list[dict] = []
        self.failure: str | None = None
        self._flushed_at = 0.0
        if self.path is None:
            return
        self.csv = self.path.suffix.lower() == ".csv"
        if resume_step is not None and self.path.exists():
            self.records = [
                r for r in self._read() if r.get("kind") in ("train", "eval") and int(r["step"]) <= resume_step
            ]
        self.flush()

    def _read(self) -> list[dict]:
        import csv

        assert self.path is not None  # read only when writing to a file

        if self.csv:
            with open(self.path) as f:
                return [
                    # whole numbers stay whole: the file is rewritten from these records
                    {k: (_number(v) if k not in ("kind", "table") and v != "" else v) for k, v in row.items()}
                    for row in csv.DictReader(f)
                ]
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _line(self, rec: dict) -> str:
        if self.csv:
            return ",".join("" if rec.get(k) is None else str(rec.get(k)) for k in self.FIELDS) + "\n"
        return strict_json.dumps(rec) + "\n"

    def add(self, rec: dict) -> None:
        import time

        self.records.append(rec)
        if self.tensorboard is not None:
            self.tensorboard.add(rec)
        due = rec.get("kind") == "eval" or time.monotonic() - self._flushed_at >= self.FLUSH_EVERY_S
        if self.path is not None and due:
            self.flush()

    def flush(self) -> None:
        """Write every record so far (whole or not at all); a failure is kept in `failure`."""
        import time

        from tpurec.errors import UserError
        from tpurec.outputs import write_atomic

        if self.tensorboard is not None:
            self.tensorboard.flush()
        if self.path is None:
            return
        head = ",".join(self.FIELDS) + "\n" if self.csv else ""
        try:
            write_atomic(self.path, head + "".join(self._line(r) for r in self.records), "--metrics-out", True)
            self.failure = None
        except UserError as e:
            self.failure = str(e)
        self._flushed_at = time.monotonic()


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def summary_text(r: dict, data_dir: str | os.PathLike | None) -> str:
    lines = [
        "",
        f"tpurec train: {r['model']} on {r['world_size']} rank(s), batch {r['batch_size']}/rank, data {data_dir}",
        f"  steps          {r['steps']:,}   ({r['seconds']:.1f} s wall)",
        f"  throughput     {r['samples_per_s']:,.0f} samples/s",
        f"  eval AUC       {r['auc']:.4f}"
        + (f"   (oracle {r['oracle_auc']:.4f}, gap {r['oracle_auc'] - r['auc']:+.4f})" if r.get("oracle_auc") else ""),
        f"  eval NE        {r['ne']:.4f}   logloss {r['logloss']:.4f}   accuracy {r['accuracy']:.4f}"
        f"   ({r['eval_rows']:,} rows)",
    ]
    lines += best_summary_lines(r)
    z = r.get("zch")
    if z:
        hit = "n/a" if z["hit_rate"] is None else f"{z['hit_rate']:.1%}"
        lines.append(
            f"  zch remap      {z['remapped_ids']:,} ids ({hit} in their own slot), {z['evictions']:,} evictions, "
            f"occupancy {z['occupancy']:.1%} of {z['slots']:,} slots ({z['eviction']})"
        )
    if r["eval_rows"] < MIN_EVAL_ROWS_FOR_AUC:
        lines.append(f"  warning        {noisy_auc_text(r['eval_rows'])}")
    if r.get("recompiles_after_warmup"):  # an emulated TPU run's count (None on a TPU, absent on CPU)
        lines.append(f"  warning        {recompiles_text(r['recompiles_after_warmup'], r.get('recompiled_ops') or {})}")
    return "\n".join(lines)


def recompiles_text(count: int, ops: dict[str, int]) -> str:
    """The terminal's word on programs first compiled after warm-up (`recompiles_after_warmup`): each one
    a new XLA compilation in the middle of a TPU run."""
    which = f" ({', '.join(f'{op} {n}' for op, n in ops.items())})" if ops else ""
    return (
        f"{count} program(s) compiled after warm-up{which}: a shape or dtype followed the data, and on a TPU "
        "each is a new compilation mid-run (recompiles_after_warmup, recompiled_ops in the JSON line)"
    )


# Below this many eval rows an AUC moves by several hundredths from one sample to the next (its
# standard error is about 0.5/sqrt(rows of the rarer label), Hanley & McNeil 1982).
MIN_EVAL_ROWS_FOR_AUC = 1000


def noisy_auc_text(rows: int) -> str:
    return (
        f"AUC from {rows:,} eval rows is noisy (fewer than {MIN_EVAL_ROWS_FOR_AUC:,}): "
        "raise --eval-fraction or give more data"
    )


def json_safe(value: object) -> object:
    """`value` with every non-finite float replaced by None (recursively through dicts and lists)."""
    return strict_json.finite(value)
