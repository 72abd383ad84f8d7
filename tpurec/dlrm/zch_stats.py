"""`tpurec data stats --zch`: id limits counted after `tpurec train --zch`'s remap.

With --zch the SparseCore kernels see no raw id: they see the slots TorchRec's MCH remap gives the ids
(tpurec.dlrm.zch), and which rows those are (so which partitions they fill) follows from the remap's
history. This pass replays that remap on the host as a `tpurec train --zch` run of the plan's layout
performs it, and counts the remapped ids as `data stats` counts any (tpurec.planner.limits_cli):

- the batches are the run's: its training split and shuffle (`--seed`, `--eval-fraction`), each rank's
  reader (tpurec.dlrm.data.make_readers), a global batch being the ranks' batches in rank order, for
  the run's steps (`--steps`, else `--epochs` of the split; the model's defaults, as `tpurec train`'s);
- the remap is TorchRec's own MCH module per table and rank, built as training shards it: the table's
  module (`tpurec.dlrm.zch.mch_module`, zch_size = the table's rows, grown as `train --zch` grows them
  over several ranks) rebuilt for each row-wise block (`rebuild_with_output_id_range`), each fed the
  ids the remap's input all-to-all brings it: hashed by the module's `preprocess`, bucketed by blocks
  of the input range, in (feature, source rank, sample) order; then profile (eviction every
  `--zch-eviction-interval` steps) and remap, as `ShardedManagedCollisionCollection` calls them;
- the tables are sharded row-wise (the remap's only sharding), TorchRec's split; a `--plan` must
  shard them so.

Evaluation batches are not replayed: they do not change the remap, and training's own demand
(`--limits-out`) counts training batches only. The limits file records the remap (`zch`), and
`tpurec train --limits` takes it only with the same --zch flags (tpurec.planner.id_limits.remap_problem).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from tpurec.dlrm import flags
from tpurec.dlrm.options import TrainOptions
from tpurec.dlrm.zch import ZchSpec
from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.dlrm.configs import DLRMConfig
    from tpurec.embedding.demand import TableShards

ZCH_FLAGS = ("zch_eviction", "zch_eviction_interval")  # `tpurec train`'s, lent as they are
RUN_FLAGS = ("seed", "eval_fraction", "steps", "epochs")  # which batches the run reads, in which order


def register(actions: argparse._SubParsersAction) -> None:
    """`--zch` and the flags it needs, on `tpurec data stats` (registered by tpurec.planner.limits_cli)."""
    stats = actions.choices["stats"]
    group = stats.add_argument_group(
        "after the remap (--zch)", "count the ids `tpurec train --zch` remaps, as a run with these flags reads them"
    )
    group.add_argument(
        "--zch",
        action="store_true",
        help="count the rows `tpurec train --zch`'s remap gives raw ids (data convert/synth --raw-ids), "
        "not the raw ids: limits for `tpurec train --zch --limits`",
    )
    flags.add_flags(group, TrainOptions, only=ZCH_FLAGS + RUN_FLAGS)
    stats.set_defaults(run=run)


def _default(name: str) -> Any:
    return next(f.default for f in flags.flagged_fields(TrainOptions) if f.name == name)


def run(args: argparse.Namespace) -> int:
    from tpurec.planner import limits_cli

    given = [n for n in ZCH_FLAGS + RUN_FLAGS if getattr(args, n) != _default(n)]
    if not args.zch:
        if given:
            raise UserError(f"{flags.option_string(given[0])} is for --zch")
        return limits_cli.run(args)
    if not args.model:
        used = "--tables" if args.tables else "--model-module"
        raise UserError(f"--zch counts the ids of `tpurec train --zch`'s tables: give --model, not {used}")
    from tpurec.dlrm.zch import data_problem

    problem = data_problem(args.path)
    if problem:
        raise UserError(problem)
    from tpurec.data.mapping import spec_from_args
    from tpurec.dlrm.configs import get_config, override

    runs = {n: getattr(args, n) for n in RUN_FLAGS if getattr(args, n) is not None}
    cfg = override(get_config(args.model), **runs)
    spec = ZchSpec(args.zch_eviction, args.zch_eviction_interval)
    columns = spec_from_args(args)
    return limits_cli.run(args, TrainingRemap(cfg, spec, columns if columns.given() else None, args.plan))


class TrainingRemap:
    """The remapped ids of a `tpurec train --zch` run (limits_cli.RemappedIds)."""

    def __init__(self, cfg: DLRMConfig, spec: ZchSpec, columns: Any, plan: str | None) -> None:
        self.cfg, self.spec, self.columns, self.plan = cfg, spec, columns, plan
        self.record = spec.record()

    def tables(self, report: dict, layout: dict) -> list[TableShards]:
        """Every table row-wise over the layout's ranks, TorchRec's split (ceil(rows / ranks) each, the
        last ranks what is left), its rows grown as `train --zch` grows them (tpurec.dlrm.zch.remap_rows)."""
        from tpurec.dlrm.zch import remap_rows
        from tpurec.embedding.demand import TableShards
        from tpurec.planner.id_limits import table_layouts

        world = layout["world_size"]
        planned = {t.name: t for t in table_layouts(report)}
        out = []
        for t in report["tables"]:
            rows = remap_rows(int(t["rows"]), world)
            block = -(-rows // world)
            shards = tuple(sorted({(r * block, max(0, min(block, rows - r * block))) for r in range(world)}))
            if self.plan and planned[t["name"]].shards != shards:
                raise UserError(
                    f"--plan {self.plan} shards table {t['name']} as {list(planned[t['name']].shards)} (first row, "
                    f"rows), not row-wise over {world} ranks as --zch does {list(shards)}: use a plan of "
                    "`tpurec train --zch --save-plan`"
                )
            out.append(TableShards(t["name"], tuple(t["features"]), rows, shards))
        return out

    def batches(self, path: str, layout: dict, tables: list[TableShards]) -> _RemappedBatches:
        from tpurec.dlrm.data import make_readers

        world, batch = layout["world_size"], layout["batch_size_per_device"]
        readers = []
        for rank in range(world):
            r = make_readers(
                path,
                batch,
                rank,
                world,
                seed=self.cfg.seed,
                eval_fraction=self.cfg.eval_fraction,
                table_sizes=[t.rows for t in tables],
                warn=lambda *a: None,
                keep_raw_ids=True,
                columns=self.columns,
            )
            if r.batch_size != batch:
                raise UserError(
                    f"{path}: {r.train.num_rows:,} training rows per rank, fewer than a batch of {batch:,}: "
                    f"`tpurec train` caps its batch at {r.batch_size:,}; measure with --batch-size {r.batch_size}"
                )
            readers.append(r.train)
        cfg = self.cfg
        steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * len(readers[0])))
        return _RemappedBatches(readers, steps, _Remap(tables, self.spec, world))


class _Remap:
    """Each table's MCH module per rank, as the sharded remap holds them, fed as it feeds them."""

    def __init__(self, tables: list[TableShards], spec: ZchSpec, world: int) -> None:
        from tpurec.dlrm.zch import mch_module

        self.tables, self.world = tables, world
        self.modules: dict[str, list[Any]] = {}
        for t in tables:
            ends = [first for first, _ in t.shards] + [t.rows]  # TorchRec's output_segments
            # a module of its own for every rank (its eviction policy too), as each rank builds one
            self.modules[t.name] = [
                mch_module(t.name, t.rows, spec).rebuild_with_output_id_range(
                    output_id_range=(first, first + size), output_segments=ends
                )
                for first, size in t.shards
            ]

    def __call__(self, kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """The global batch (the ranks' batches in rank order), its ids remapped to table rows."""
        import torch
        from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

        parts = [k.to_dict() for k in kjts]
        keys = list(kjts[0].keys())
        values = {f: torch.cat([p[f].values() for p in parts]) for f in keys}
        lengths = {f: torch.cat([p[f].lengths() for p in parts]) for f in keys}
        for t in self.tables:
            modules = self.modules[t.name]
            sizes = [values[f].numel() for f in t.features]
            raw = torch.cat([values[f] for f in t.features])
            # the module's input hash, as the sharded remap applies it before its all-to-all
            whole = {t.name: JaggedTensor(values=raw, lengths=torch.tensor([raw.numel()]))}
            hashed = modules[0].preprocess(whole)[t.name].values()
            # the input all-to-all's buckets: blocks of the input range, one per rank (block_bucketize)
            block = -(-modules[0].input_size() // len(modules))
            bucket = hashed // block
            out = torch.empty_like(raw)
            for rank, mcm in enumerate(modules):
                mine = bucket == rank
                jt = {t.name: JaggedTensor(values=hashed[mine], lengths=torch.tensor([int(mine.sum())]))}
                out[mine] = mcm.remap(mcm.profile(jt))[t.name].values()
                mcm.evict()  # the sharded module takes the evicted slots every step (their rows reset)
            for f, chunk in zip(t.features, torch.split(out, sizes)):
                values[f] = chunk
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([values[f] for f in keys]),
            lengths=torch.cat([lengths[f] for f in keys]),
        )


class _RemappedBatches:
    """`steps` global batches of the ranks' training readers, epoch after epoch as training reads them,
    remapped in order (the remap's state follows the batches)."""

    def __init__(self, readers: list, steps: int, remap: _Remap) -> None:
        self.readers, self.steps, self.remap = readers, steps, remap

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[SimpleNamespace]:
        from tpurec.dlrm.training.data import endless

        streams = [endless(r) for r in self.readers]
        for _ in range(self.steps):
            batches = [next(s, None) for s in streams]
            kjts = [b.sparse_features for b in batches if b is not None]
            if len(kjts) < len(batches):
                return  # the data ran out (an empty epoch), as training stops
            yield SimpleNamespace(sparse_features=self.remap(kjts))
