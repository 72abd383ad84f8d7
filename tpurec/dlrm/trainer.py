"""One rank's DLRM training run as a `Trainer`: setup, step, evaluate, checkpoint, run.

`tpurec train` (one rank, in-process) and `python -m tpurec.dlrm` (each rank under torchrun) build a
Trainer from `TrainOptions` and call `run()`. Setup follows the data: the process group first (the
synthetic data's writer and the other ranks meet at a barrier), then the data (the table sizes come
from it), then the model, its DMP, optimizers and pipeline, and last the resume, which loads into all
of them. Training goes in segments that end at the next eval, checkpoint or the last step; the
pipeline drains at a segment's end, so the reader position then is exactly that of the batches
trained (what a checkpoint records).

Everything but the final JSON line (rank 0) goes to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tpurec import strict_json
from tpurec.data.catalog import get_table_set
from tpurec.dlrm import keep_best
from tpurec.dlrm.ckpt.manager import CheckpointManager
from tpurec.dlrm.keep_best import BestEval
from tpurec.dlrm.options import OPTIONS_ENV, TrainOptions
from tpurec.dlrm.rank_setup import check_host_memory, init_distributed, log, setup_logging
from tpurec.dlrm.report import (
    MIN_EVAL_ROWS_FOR_AUC,
    MetricsLog,
    noisy_auc_text,
    plan_report,
    plan_report_of,
    plan_summary,
    summary_text,
)
from tpurec.errors import UserError
from tpurec.runtime import stop_request, storage
from tpurec.runtime.device import DeviceKind, resolve_choice

if TYPE_CHECKING:
    import torch
    from torchrec.datasets.utils import Batch

    from tpurec.data.reader import ParquetReader
    from tpurec.dlrm.user_model import UserModel
    from tpurec.dlrm.zch import RemapCounters
    from tpurec.emulation.rank import EmulatedRank


def endless(reader: ParquetReader) -> Iterator[Batch]:
    """The reader's batches epoch after epoch (the reader tracks its own epoch and position); the
    loop decides when to stop. An epoch without a batch ends the stream (never spin forever), except
    the first pass: a reader resumed from a state taken right after an epoch's last batch finishes
    that epoch with no batch, and the next epoch follows."""
    first = True
    while True:
        n = 0
        for n, batch in enumerate(reader, 1):  # noqa: B007  (n counts the batches after the loop)
            yield batch
        if n == 0 and not first:
            return
        first = False


def position_in_epoch(fraction: float, num_rows: int, batch_size: int) -> int:
    """Rows of an epoch of `num_rows` to skip to resume `fraction` through it: whole batches. The
    fraction was a whole number of batches at the world size that saved it (rows / num_rows), which
    as a float times num_rows can land just below that number (1024 / 2850 * 2850 < 1024) and
    lose a batch; a relative 1e-12 (far below one row for any epoch) puts it back."""
    return int(fraction * num_rows * (1 + 1e-12)) // batch_size * batch_size


def _holds_embedding_collection(model: torch.nn.Module) -> bool:
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return any(isinstance(m, EmbeddingCollection) for m in model.modules())


class Trainer:
    """Trains one rank of a `tpurec train` run. After `setup()`: `cfg` (the resolved DLRMConfig),
    `table_set` (its catalog tables), `readers`, `dmp`, `optimizer`, `pipeline`, `step_count`,
    `checkpointer` (the run's CheckpointManager: lock, resume, interval, save, retention)."""

    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.step_count = 0  # training steps taken (the same on every rank)
        self.samples = 0  # samples trained on, over all ranks
        self._batches = _Cuttable(iter(()))  # the current segment's batches; see _train_segment
        self._stop = stop_request.StopRequest()  # run() installs its own, which signals reach
        self._stopping = 0  # the signal every rank agreed to stop for (stop_request.py); 0: none
        self._saved: tuple[int, Path] | None = None  # the step and directory of the last checkpoint written
        self._ready = False
        self.emulated: EmulatedRank | None = None  # the EmulatedRank of an emulated TPU rank (tpurec.emulation.rank)
        self._train_copies: Counter = Counter()  # device->host copies in training steps, by what
        self._output_failures: list[str] = []  # side outputs that could not be written (_side_output)
        self.remap: RemapCounters | None = None  # --zch: the remap's counters (tpurec.dlrm.zch)
        self.host_tier_tables: list[str] = []  # tables on the host tier (--host-tier, or --plan's cache_params)
        self.user: UserModel | None = None  # --model-module: the user's model (tpurec.dlrm.user_model)
        self.best = BestEval()  # the best eval AUC so far (--keep-best, --early-stop: keep_best.py)
        self._best_path: Path | None = None  # --keep-best: the checkpoint kept for it
        self._early_stop: tuple[int, dict] | None = None  # --early-stop: (the step it stopped at, that eval)
        self._eval_owed = False  # resumed where the run before evaluated last: again, for BestEval (keep_best.py)

    # ---- setup ----
    def setup(self) -> None:
        import torch

        o = self.options
        from tpurec.runtime.device import emulated_slice

        if emulated_slice():  # a rank of `tpurec train --emulate-tpu`: TorchTPU's stand-ins first
            from tpurec.emulation.rank import activate

            self.emulated = activate()
        self.device = resolve_choice(o.device)
        self.rank, self.world = init_distributed(self.device, o.dist_timeout)
        setup_logging(self.rank)
        from tpurec.runtime import heartbeat

        # Right after the group forms: a rank that stops from here on is named within the timeout.
        heartbeat.start(o.heartbeat_timeout, program="tpurec train")
        # One thread per rank unless asked: on a small shared host more threads than free cores make
        # every op wait for a busy core (measured 20x slower with 2 threads on 2 busy cores).
        torch.set_num_threads(o.threads or 1)
        self.say = log.info if self.rank == 0 else (lambda *a, **k: None)
        self.cfg = o.config()
        every = o.checkpoint_every if o.checkpoint_every is not None else self.cfg.eval_every
        self.checkpointer = CheckpointManager(o.checkpoint_dir, every=every, keep=o.keep, rank=self.rank, say=self.say)
        self.checkpointer.lock()  # before any step: one run per directory
        self.table_set = get_table_set(self.cfg.table_set)  # resolved once; everything below reads it
        if o.model_module:  # built first: the data is checked against its features
            from tpurec.dlrm.user_model import load

            self.user = load(o.model_module, self.cfg.seed)
            remapped = self.user.remap_ranges()
            if o.step != "eager" and remapped:  # as --zch: TorchRec's sharded remaps, which the steps do not take
                raise UserError(
                    f"--step {o.step} trains without managed-collision tables (--model-module {o.model_module}: "
                    f"features {', '.join(remapped)}); use --step eager"
                )
            if self.rank == 0:
                from tpurec.planner.model_module import unspread_remaps

                for line in unspread_remaps(self.user.module, self.world):
                    log.warning(line)
            if self.device == DeviceKind.CPU or self.emulated:
                rows, dims = [t.num_embeddings for t in self.user.tables], [t.embedding_dim for t in self.user.tables]
                check_host_memory(self.cfg, rows, self.world, user=(o.model_module, dims, self._table_optimizer()))
        elif self.device == DeviceKind.CPU or self.emulated:
            # Before any data is generated or read: a refusal in one line, not an OOM kill minutes in.
            sizes, source = self._table_sizes_and_source()
            check_host_memory(self.cfg, sizes, self.world, source)
        self._setup_data()
        self._setup_model()
        self._resume()
        # Before the first step, not at the first save (tpurec/dlrm/ckpt/space.py).
        self.checkpointer.check_room(self.dmp, self.optimizer)
        self._start_stream()
        self._batches = _Cuttable(itertools.islice(self._stream, self.total_steps - self.step_count))
        self._ready = True

    def _start_stream(self) -> None:
        """The training batches, prepared `--pipeline-depth` ahead in background threads (with the
        CSR inputs on one rank, `tpurec.dlrm.input_pipeline`), or read inline at depth 0."""
        from tpurec.dlrm.input_pipeline import lookups_to_prepare, make_prefetcher

        o = self.options
        self._lookups = lookups_to_prepare(self.dmp, self.world) if o.pipeline_depth and not self._remapped() else []
        self._prefetch = make_prefetcher(
            self.readers.train, self._lookups, depth=o.pipeline_depth, workers=o.pipeline_workers
        )
        self._stream = iter(self._prefetch) if self._prefetch is not None else endless(self.readers.train)
        if self.device == DeviceKind.TPU:
            from tpurec.data.host_ids import keep_ids_on_host

            # Only dense features and labels go to the TPU; the ids stay on the host for the input
            # all-to-all and SparseCore preprocessing (tpurec.data.host_ids).
            self._stream = map(keep_ids_on_host, self._stream)

    def _train_state(self) -> dict:
        """The reader's position after the last batch the step took (not the batches read ahead)."""
        return self._prefetch.state_dict() if self._prefetch is not None else self.readers.train.state_dict()

    def _table_sizes_and_source(self) -> tuple[list[int], str]:
        """The table sizes training will build, and where they come from (for messages)."""
        from tpurec.dlrm.data import model_table_sizes

        defaults = [t.num_embeddings for t in self.table_set.tables]
        if not self.options.data:
            return defaults, ""  # the synthetic data is made for the table set's own sizes
        sizes = model_table_sizes(self.options.data, defaults, self.options.column_spec())
        if sizes == defaults:
            return sizes, ""
        return sizes, f", sizes from {self.options.data}'s _dataset.json, not the {self.cfg.table_set} defaults"

    def _setup_data(self) -> None:
        import torch.distributed as dist

        from tpurec.data.mapped import large_dense_note, mapping_summary, unread_files_note, unsized_note
        from tpurec.dlrm.configs import synth_multi_hot
        from tpurec.dlrm.data import data_metadata, ensure_synth, make_readers, model_table_sizes, synth_dir

        cfg, rank, world = self.cfg, self.rank, self.world
        if self.options.data:
            self.data_dir = storage.path(self.options.data)  # a Path, or a bucket's
        else:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            if local_rank == 0:  # one writer per host; the others wait at the barrier
                # Under the --nproc launcher (options in OPTIONS_ENV) it made the data and said so.
                launched = OPTIONS_ENV in os.environ
                quiet = (lambda m: None) if launched else self.say
                ensure_synth(cfg.table_set, cfg.synth_rows, cfg.seed, say=quiet, multi_hot=synth_multi_hot(cfg))
            if world > 1:
                dist.barrier()
            self.data_dir = synth_dir(cfg.table_set, cfg.synth_rows, cfg.seed, synth_multi_hot(cfg))
        if self.options.zch:
            from tpurec.dlrm.zch import data_problem

            problem = data_problem(str(self.data_dir))
            if problem:
                raise UserError(problem)
        columns = self.options.column_spec()  # the column mapping of Parquet tpurec did not write
        meta = data_metadata(self.data_dir, columns)
        unread = unread_files_note(self.data_dir, meta)
        if unread:
            self.say(unread)
        if "mapping" in meta:
            self.say(f"data: {self.data_dir}: Parquet read through a column mapping: {mapping_summary(meta)}")
            large = None if self.options.dense_transform else large_dense_note(meta)
            if large:
                self.say(large)
        if self.options.dense_transform:
            self.say("data: every dense column read as log(1 + max(x, 0)) (--dense-transform log1p)")
        defaults = [t.num_embeddings for t in self.table_set.tables]
        if self.user is not None:  # each column's table: the model's (tpurec.dlrm.user_model)
            from tpurec.dlrm.user_model import data_table_sizes

            self.table_sizes = defaults = data_table_sizes(self.user, meta, str(self.data_dir))
        else:
            self.table_sizes = model_table_sizes(self.data_dir, defaults, columns)
            note = unsized_note(meta, self.table_sizes, cfg.table_set)
            if note:
                self.say(note)
        if self.table_sizes != defaults:
            mapped = "mapping" in meta  # sizes from --sparse NAME:ROWS (or --columns)
            self.say(
                f"tables: sizes from {self.data_dir}'s {'column mapping' if mapped else '_dataset.json'}: "
                f"{sum(self.table_sizes):,} rows in all (the {cfg.table_set} defaults have {sum(defaults):,})"
                + ("" if mapped else f"; convert with --table-set {cfg.table_set} to train the model's own sizes")
            )
        self.feature_names = [f["name"] for f in meta.get("sparse", [])]
        from tpurec.dlrm.host_tier import table_names

        self.host_tier_tables = table_names(self.options.host_tier, self.options.plan)  # --host-tier's, or --plan's
        self.num_dense = len(meta.get("dense") or [])  # the model takes the data's dense features
        if not self.num_dense and self.user is None:
            raise UserError(f"{self.data_dir}: no dense columns; the DLRM's bottom MLP needs at least one")
        self.readers = make_readers(
            self.data_dir,
            cfg.batch_size,
            rank,
            world,
            seed=cfg.seed,
            eval_fraction=cfg.eval_fraction,
            table_sizes=self.table_sizes,
            warn=log.warning if rank == 0 else (lambda *a: None),
            keep_raw_ids=self.options.zch,  # --zch: TorchRec's remap takes the raw ids
            columns=columns,
            # a --model-module's managed-collision tables: so do their remaps (tpurec.dlrm.user_model)
            remap_ranges=self.user.remap_ranges() if self.user is not None else None,
            dense_log1p=self.options.dense_transform == "log1p",
            # On a TPU every shape is compiled in: evaluating at the training batch reuses the step's
            # lookup program and id limits; another eval batch would be another program, other buffers.
            # A host-tier table's cache is sized for the training batch's rows (--host-tier): so is eval's.
            **({"eval_batch_size": cfg.batch_size} if self.device == DeviceKind.TPU or self.host_tier_tables else {}),
        )
        self.batch_size = batch = self.readers.batch_size
        if batch != cfg.batch_size:
            from tpurec.dlrm.configs import override

            # Capped to the rows a rank holds: the model is planned (and its memory checked) for
            # the batch it trains, not the one asked for.
            self.cfg = cfg = override(cfg, batch_size=batch)
        steps_per_epoch = len(self.readers.train)
        self.total_steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
        self.oracle_auc = oracle = meta.get("oracle_auc")
        self.say(
            f"data: {self.data_dir}: {meta.get('rows', '?'):,} rows; per rank {self.readers.train.num_rows:,} "
            f"train / {self.readers.eval_rows:,} eval rows; {steps_per_epoch} steps per epoch of global batch "
            f"{batch * world:,}" + (f"; oracle AUC {oracle:.4f}" if oracle else "")
        )
        eval_rows = self.readers.eval_rows * world  # about: ranks may hold a row more or less
        if eval_rows < MIN_EVAL_ROWS_FOR_AUC and rank == 0:
            log.warning(noisy_auc_text(eval_rows))

    def _setup_model(self) -> None:
        import torch

        from tpurec.dlrm.input_pipeline import train_pipeline
        from tpurec.dlrm.model import LRSchedule, build_model, build_optimizer, shard

        cfg, o = self.cfg, self.options
        torch.manual_seed(cfg.seed)
        zch = o.zch_spec()
        if zch is not None:
            self._zch_table_sizes()
        constraints = None  # the built-in DLRM's (model.planner_constraints)
        if self.user is not None:
            from tpurec.dlrm.user_model import apply_table_optimizer

            apply_table_optimizer(self.user, cfg)
            model, constraints = self.user.module, self.user.constraints or {}
        else:
            model = build_model(
                cfg, table_sizes=self.table_sizes, feature_names=self.feature_names, zch=zch, num_dense=self.num_dense
            )
        if o.host_tier:  # tables on the host tier, in the planner's words (tpurec/dlrm/host_tier.py)
            constraints = self._host_tier_constraints(model, constraints)
        plan = None
        if o.plan:
            from tpurec.planner.plan_io import load_plan

            plan = load_plan(o.plan)
        from tpurec.planner.plan_check import PlanMismatchError

        # --step compiled|pipelined take an EmbeddingCollection on its fixed-shape output path only
        # (tpurec/sharding/ec_preprocess.py): on CPU ranks too, with fixed limits; EBCs keep theirs
        fixed = True if o.step != "eager" and _holds_embedding_collection(model) else None
        try:
            # the --limits file is read and checked against the model by DMP (tpurec/sharding/dmp.py)
            self.dmp = shard(
                model, cfg, self.device, plan=plan, id_limits=o.id_limits, constraints=constraints, fixed_limits=fixed
            )
        except PlanMismatchError as e:  # DMP says "the plan": name the file
            raise e.named(f"--plan {o.plan}") from None
        if o.plan:  # after DMP's shard checks, as the launcher's preflight orders them
            from tpurec.planner.plan_check import check_plan_world
            from tpurec.planner.plan_io import read_doc

            check_plan_world(read_doc(o.plan), self.world, f"--plan {o.plan}")
        if zch is not None:
            from tpurec.dlrm.zch import RemapCounters

            self.remap = RemapCounters(zch).attach(self.dmp)
            self.say(
                f"--zch: {len(self.remap.tables)} managed-collision table(s) on this rank, {zch.eviction} eviction "
                f"every {zch.eviction_interval} steps"
            )
        elif self._remapped():
            self._count_model_remaps()
        self.optimizer = build_optimizer(self.dmp, cfg)
        self.schedule = LRSchedule(self.optimizer, cfg.warmup_steps, cfg.decay_start, cfg.decay_steps)
        if self.rank == 0:
            self._report_plan()
        device = torch.device(self.device) if self.device == DeviceKind.CPU else self.dmp.device
        if o.step != "eager":  # tpurec's compiled or pipelined step (sharding/step/); options.py refuses a real TPU
            from tpurec.sharding.step.kinds import StepPipeline

            # compiled only with fixed SparseCore buffer sizes (--limits): else a graph per batch
            fixed = o.id_limits is not None
            self.pipeline: Any = StepPipeline(o.step, self.dmp, self.optimizer, compile=fixed, device=device)
            how = "under torch.compile" if fixed else "eagerly (no --limits: buffer sizes follow each batch)"
            self.say(f"--step {o.step}: the steady step runs {how}")
            return
        self.pipeline = train_pipeline(
            self.dmp,
            self.optimizer,
            device,
            world_size=self.world,
            workers=o.pipeline_workers,
            # --zch, a model's MC tables: the lookups take the remapped ids, known only in the step
            prepare=o.pipeline_depth > 0 and not self._remapped(),
        )

    def _host_tier_constraints(self, model: Any, constraints: dict | None) -> dict:
        """The planner's constraints with --host-tier's tables on the host tier: the model's own (a
        --model-module's), or the built-in DLRM's (model.planner_constraints)."""
        from tpurec.dlrm import host_tier
        from tpurec.dlrm.model import planner_constraints

        assert self.options.host_tier is not None
        if self.user is not None:
            names = [t.name for t in self.user.tables]
        else:
            names = [c.name for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
            constraints = planner_constraints(self.cfg, self.device, names)
        return host_tier.constraints(self.options.host_tier, names, constraints)

    @property
    def model_name(self) -> str:
        """The model trained, as the result line and the reports name it: the config, or MOD:FN."""
        return self.options.model_module or self.cfg.name

    def _remapped(self) -> bool:
        """Tables behind a managed-collision remap: --zch's, or a --model-module's own."""
        return self.options.zch or (self.user is not None and bool(self.user.remap_ranges()))

    def _count_model_remaps(self) -> None:
        """A --model-module's own managed-collision tables: their remaps counted as --zch's are
        (tpurec.dlrm.zch.RemapCounters), said in one line with what they take."""
        from tpurec.dlrm.zch import RemapCounters

        assert self.user is not None
        self.remap = RemapCounters(None).attach(self.dmp)
        ranges = self.user.remap_ranges()
        said = ", ".join(f"{f} (ids below {n:,})" for f, n in ranges.items())
        eviction, interval = self.remap.policy()
        counted = (
            f"{len(self.remap.tables)} counted on this rank ({eviction} eviction every {interval} steps)"
            if self.remap.tables
            else "none counted"
        )
        uncounted = f"; not counted: {', '.join(self.remap.uncounted)} (not MCHManagedCollisionModule)"
        self.say(
            f"managed-collision tables of {self.user.target}: features {said} read unhashed for the remap; "
            f"{counted}{uncounted if self.remap.uncounted else ''}"
        )
        if not self.remap.tables:
            self.remap = None

    def _table_optimizer(self) -> str:
        """The tables' optimizer: a `--model-module` model's own when it set one, else the config's."""
        if self.user is not None and self.user.own_optimizer:
            from tpurec.planner.planners import infer_optimizer

            return infer_optimizer(self.user.module) or self.cfg.embedding_optimizer
        return self.cfg.embedding_optimizer

    def _zch_table_sizes(self) -> None:
        """--zch over several ranks: tables too small for a row-wise block of >= 2 rows on every rank
        grow to the smallest size that has one (tpurec.dlrm.zch.remap_rows), said in one line."""
        from tpurec.dlrm.zch import remap_rows

        sizes = [remap_rows(n, self.world) for n in self.table_sizes]
        grown = [f"{t.name} {a} -> {b}" for t, a, b in zip(self.table_set.tables, self.table_sizes, sizes) if a != b]
        if grown:
            self.say(
                f"--zch at {self.world} ranks: every rank holds a row-wise block of every managed-collision table, "
                f"of >= 2 rows (one id and TorchRec's end marker); rows grown: {', '.join(grown)}"
            )
            self.table_sizes = sizes

    def _report_plan(self) -> None:
        report = None
        try:
            if self.user is not None:
                report = plan_report_of(
                    self.dmp, self.user.tables, self.batch_size, self._table_optimizer(), self.model_name
                )
            else:
                report = plan_report(self.dmp, self.cfg, self.table_set, self.table_sizes, self.batch_size)
            self.say(plan_summary(report))
        except Exception as e:  # the summary is informative only; never fail a run on it
            self.say(f"(plan summary unavailable: {e})")
        # one writer per host (a later --plan reads it on every host)
        if self.options.save_plan and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from tpurec.planner.plan_io import save_plan

            with self._side_output():
                save_plan(self.dmp.plan, self.options.save_plan, report["meta"] if report else None, "--save-plan")
                self.say(f"plan saved to {self.options.save_plan}")

    def _checkpoint_config(self) -> dict:
        """The config a checkpoint records and a resume must match: the model's, and whether its tables
        are behind the managed-collision remap (--zch: other state, other tensors)."""
        own = self.user.checkpoint_config() if self.user is not None else {}
        o = self.options
        # the remap's state differs by eviction policy, and its per-rank blocks by world size
        zch = {"zch_eviction": o.zch_eviction, "zch_ranks": self.world} if o.zch else {}
        # other dense inputs are another model's: --dense-transform resumes only as it was written
        return {**self.cfg.to_dict(), "zch": o.zch, **zch, "dense_transform": o.dense_transform, **own}

    def _resume(self) -> None:
        """`--resume`: the checkpoint manager finds, checks and loads the checkpoint into the model and
        optimizers; the step count and the data position follow here."""
        train = self.readers.train
        loaded = self.checkpointer.resume(self.options.resume, self.dmp, self.optimizer, self._checkpoint_config())
        if loaded is None:
            return
        cmeta, state = loaded
        self.step_count, self.samples = cmeta["step"], cmeta["samples"]
        self.best = BestEval.from_meta(cmeta, cmeta["path"])  # compared and counted as the run before
        o = self.options
        self._eval_owed = bool(o.keep_best or o.early_stop) and self.best.owed(self.step_count, self.cfg.eval_every)
        if state is not None:
            self.checkpointer.restore(state, train)
            how = "exact (same world size)"
        else:
            # Another world size: rows are dealt out differently, so continue at the same epoch and
            # the same fraction of it (rows near the cut may be seen twice or skipped in that epoch).
            st = train.state_dict()
            frac = float(cmeta["epoch_fraction"])
            st.update(epoch=cmeta["epoch"], rows_consumed=position_in_epoch(frac, train.num_rows, self.batch_size))
            train.load_state_dict(st)
            how = (
                f"at world size {self.world} from {cmeta['world_size']}: data position approximate "
                f"(epoch {st['epoch']}, {frac:.1%} through it)"
            )
        self.say(f"resume: {cmeta['path']} at step {self.step_count}, {how}")
        if self.step_count > self.total_steps:
            raise UserError(
                f"resume: the checkpoint is at step {self.step_count}, past the {self.total_steps} steps asked "
                "for: nothing to train (raise --steps / --epochs, or resume an earlier checkpoint)"
            )
        if self.step_count == self.total_steps:
            self.say(f"resume: already at the last step ({self.total_steps}); evaluating only")

    # ---- the four things a run does ----
    def step(self) -> float | None:
        """One training step on the next batch of the current segment: its loss, or None once the
        segment has no batch left and the pipeline has drained (after setup(), the segment runs to
        the last step; run() cuts it at every eval and checkpoint)."""
        loss = self._advance()
        return None if loss is None else self._read_loss(loss, 1)

    def _advance(self) -> torch.Tensor | None:
        """One training step; its loss as a tensor where the step computed it (on a TPU: on the TPU,
        read by the host only at a log point, `_read_loss`), or None when the segment is done."""
        if self.emulated:
            self.emulated.begin("train")
        self.schedule.set_step(self.step_count)
        try:
            loss, _, _ = self.pipeline.progress(self._batches)
        except StopIteration:
            return None
        self.step_count += 1
        self.samples += self.batch_size * self.world
        return loss.detach()

    def _read_loss(self, loss_sum: torch.Tensor | float, steps: int) -> float:
        """The mean of the last `steps` losses (summed in `loss_sum`) on the host: a device->host copy
        on a TPU (counted, tpurec.runtime.host_copies). Non-finite stops training."""
        import torch

        from tpurec.runtime import host_copies

        assert isinstance(loss_sum, torch.Tensor)  # read after a step has run
        if self.emulated:
            host_copies.mark_on_device(loss_sum)  # a real rank computes the loss on its TPU
        value = float(host_copies.to_host(loss_sum, "loss")) / steps
        if not math.isfinite(value):
            # Training on would only spread NaN through every table; checkpoints already written stay.
            first = self.step_count - steps + 1
            where = f"step {self.step_count}" if steps == 1 else f"steps {first}-{self.step_count}"
            raise UserError(
                f"training loss is {value} at {where}: stopped. Look for non-finite dense "
                "values in the data (`tpurec data inspect`), or lower --embedding-lr / --dense-lr"
            )
        return value

    def evaluate(self) -> dict:
        """Forward the whole eval split through the (drained) pipeline; metrics over all ranks."""
        import torch

        if self.emulated:
            self.emulated.begin("eval")

        from tpurec.dlrm import metrics
        from tpurec.dlrm.data import eval_batches

        self.dmp.eval()
        if self.remap is not None:
            self.remap.reset_eval()  # the eval figures are this evaluation's
        logits, labels = [], []
        it = eval_batches(self.readers.eval)
        if self.device == DeviceKind.TPU:
            from tpurec.data.host_ids import keep_ids_on_host

            it = map(keep_ids_on_host, it)
        with torch.no_grad():
            while True:
                try:
                    _, lo, la = self.pipeline.progress(it)
                except StopIteration:
                    break
                logits.append(lo)
                labels.append(la)
        self.dmp.train()
        lo = torch.cat(logits)[: self.readers.eval_rows]  # drop the padding of the last batch
        la = torch.cat(labels)[: self.readers.eval_rows]
        return metrics.compute(*metrics.gather(lo, la))

    def checkpoint(self) -> Path:
        """Save model, optimizer, reader position and RNG states at the current step (every rank)."""
        st = self._train_state()
        s = self.step_count
        self._saved = (s, self.checkpointer.save(s, self.dmp, self.optimizer, st, self._checkpoint_meta(st)))
        return self._saved[1]

    def _checkpoint_meta(self, st: dict) -> dict:
        """meta.json of a checkpoint at this step (`st`: the reader's position)."""
        return {
            "step": self.step_count,
            "samples": self.samples,
            "world_size": self.world,
            "batch_size": self.batch_size,
            "epoch": st["epoch"],
            "epoch_fraction": st["rows_consumed"] / max(1, self.readers.train.num_rows),
            "config": self._checkpoint_config(),
            "data": str(self.data_dir),
            keep_best.META_KEY: self.best.record(),
        }

    def _evaluated(self, ev: dict) -> None:
        """An evaluation at this step (every rank, the same figures): the best so far, kept as a
        checkpoint (--keep-best) when it is, and --early-stop's count."""
        o = self.options
        if self.best.seen(self.step_count, ev["auc"]) and o.keep_best:
            st = self._train_state()
            meta = {**self._checkpoint_meta(st), "eval": {k: ev[k] for k in ("auc", "ne", "logloss", "accuracy")}}
            self._best_path = self.checkpointer.save_best(self.step_count, self.dmp, self.optimizer, st, meta)
        if o.early_stop and self.best.since >= o.early_stop and self.step_count < self.total_steps:
            self._early_stop = (self.step_count, ev)

    def run(self) -> dict:
        """Set up (if not yet), train to the last step with evals and checkpoints on the way, then
        checkpoint, evaluate and report (rank 0: summary on stderr, one JSON line on stdout).
        Returns the final figures (the JSON line's)."""
        from tqdm import tqdm

        if not self._ready:
            self.setup()
        o, cfg, total = self.options, self.cfg, self.total_steps
        resumed_at = self.step_count if o.resume and self.step_count > 0 else None
        tensorboard = None
        if o.tensorboard and self.rank == 0:
            from tpurec.dlrm.tensorboard_log import TensorBoardLog

            tensorboard = TensorBoardLog(o.tensorboard, resumed_at)
        self._metrics = MetricsLog(o.metrics_out if self.rank == 0 else None, resumed_at, tensorboard)
        self._bar = tqdm(
            total=total,
            initial=self.step_count,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            # A log file is no terminal: \r-joined bar updates there are noise; plain lines instead.
            disable=self.rank != 0 or o.quiet or not sys.stderr.isatty(),
            mininterval=0.5,
            smoothing=0.1,
        )
        self._t_start = time.perf_counter()
        self._train_seconds, self._steps_run = 0.0, 0
        self._window_seconds, self._window_steps = 0.0, 0  # training since the last logged step
        self._log_every = max(1, min(50, total // 100 or 1))
        self._loss_sum: torch.Tensor | float = 0.0  # a tensor once a step has run
        self._loss_n = 0

        def boundary(s: int) -> bool:
            return s == total or (cfg.eval_every and s % cfg.eval_every == 0) or self.checkpointer.is_due(s)

        if self._eval_owed and self.step_count < total:  # not logged: the metrics file holds it
            self._evaluated(self.evaluate())
        self._stop = stop_request.StopRequest()
        # SIGTERM (a preemption) is recorded to the end of the run, through evaluations and saves,
        # and stops it at the next point the ranks agree on; Ctrl-C only within training segments.
        with stop_request.catching(self._stop, stop_request.PREEMPTION):
            try:
                while self.step_count < total and not self._stopping and self._early_stop is None:
                    with stop_request.catching(self._stop):
                        self._train_segment(next(s for s in range(self.step_count + 1, total + 1) if boundary(s)))
                    if not self._stopping:
                        self._after_segment(total)
            except BaseException:  # Ctrl-C, a failed step: the records so far reach the file
                self._metrics.flush()
                raise
            self._bar.close()
            if self._prefetch is not None:
                self._prefetch.close()
            for m in self._lookups:
                m.clear_prepared()  # batches read ahead that training will not take
            saved_here = self._saved is not None and self._saved[0] == self.step_count  # an early stop's
            if not self._stopping and self.checkpointer.enabled and not saved_here:
                # Written before the final evaluation, so the training it saves never depends on the
                # evaluation succeeding (issue #36 item 2: on a TPU it once failed and lost this checkpoint).
                self.checkpoint()
                self._stopping = self._stop.agreed(self.world)  # a SIGTERM during it: stop, it is saved
            if self._stopping:
                with stop_request.catching(self._stop):  # the relayed copies of the signal must not cut the save
                    self._stop_here()
            return self._finish()

    def _after_segment(self, total: int) -> None:
        """The evaluation and the periodic checkpoint due where a training segment ended."""
        cfg, step = self.cfg, self.step_count
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
            ev = self._log_eval(self.evaluate())
            if self.rank == 0:
                self._bar.write(
                    f"step {step}: eval AUC {ev['auc']:.4f}, NE {ev['ne']:.4f}, logloss {ev['logloss']:.4f}",
                    file=sys.stderr,
                )
            self._evaluated(ev)
        if self.checkpointer.should_save(step, total):
            self.checkpoint()
        # A SIGTERM during the evaluation or the save (recorded, stop_request.PREEMPTION): every rank
        # is here, after both, so they stop at this step together.
        self._stopping = self._stop.agreed(self.world)

    def _stop_here(self) -> NoReturn:
        """A SIGTERM or Ctrl-C stopped training at an agreed step (the pipeline drained): the last
        checkpoint (every rank, when there is a checkpoint dir), then the metrics and curves (rank 0),
        then StoppedBySignal, whose line says how to resume."""
        from tpurec.dlrm.input_pipeline import close_pipeline
        from tpurec.runtime.stop_request import StoppedBySignal

        close_pipeline(self.pipeline)
        saved = None
        if self.checkpointer.enabled:  # a SIGTERM during a save stops right after it: that one is saved
            saved = self._saved[1] if self._saved and self._saved[0] == self.step_count else self.checkpoint()
        if self.rank == 0:
            self._write_curves()
        raise StoppedBySignal(self._stopping, self.step_count, saved, self.options.resume_command())

    def _finish(self) -> dict:
        """After the last step and its checkpoint (run()): the final evaluation and report."""
        from tpurec.dlrm.input_pipeline import sparsecore_lookups

        lookups = sparsecore_lookups(self.dmp)
        # --step compiled|pipelined preprocess in their own step (sharding/step/): no input pipeline to report
        if lookups and self.options.pipeline_depth and self.options.step == "eager":
            hits = sum(m.prepared_hits for m in lookups)
            misses = sum(m.prepared_misses for m in lookups)
            if hits + misses:
                self.say(f"input pipeline: SparseCore inputs built ahead for {hits} of {hits + misses} lookups")
            else:  # the CPU kernels' direct step builds no SparseCore layout (embedding/direct.py)
                self.say("input pipeline: no SparseCore inputs to build ahead (the CPU kernels' direct step)")

        if self._early_stop is not None:  # the model of the evaluation that stopped it: not evaluated again
            final = self._early_stop[1]
        else:  # the final checkpoint is written (run()); a SIGTERM now lets it end
            final = self._log_eval(self.evaluate())
            self._evaluated(final)
        from tpurec.dlrm.input_pipeline import close_pipeline

        close_pipeline(self.pipeline)  # after the final evaluation, which still runs through it
        batch, world = self.batch_size, self.world
        sps = self._steps_run * batch * world / self._train_seconds if self._train_seconds > 0 else 0.0
        result = {
            "steps": self.step_count,
            "auc": round(final["auc"], 6),
            "ne": round(final["ne"], 6),
            "logloss": round(final["logloss"], 6),
            "accuracy": round(final["accuracy"], 6),
            "samples_per_s": round(sps, 1),
            "eval_rows": final["rows"],
            "world_size": world,
            "batch_size": batch,
            "model": self.model_name,
            "step": self.options.step,
            "seconds": round(time.perf_counter() - self._t_start, 2),
        }
        if self.oracle_auc:
            result["oracle_auc"] = self.oracle_auc
        if self.options.step != "eager":  # batches over their fixed id limits leave the graph: how many
            result["eager_steps"] = self.pipeline.eager_steps
        result.update(self._slice_figures())
        result.update(self._best_figures())
        result["id_limits"] = self._id_limit_figures()
        if self.remap is not None:
            result["zch"] = self._remap_figures()
        if self.host_tier_tables:
            from tpurec.dlrm import host_tier

            result["host_tier"] = host_tier.figures(self.dmp, self.host_tier_tables, self.world)
            self.say(host_tier.summary(result["host_tier"]))
        if self.rank == 0:
            self._report(result)
        elif self._output_failures:  # another host's copy of --save-plan
            raise UserError("; ".join(self._output_failures))
        return result

    def _best_figures(self) -> dict:
        """--keep-best / --early-stop: the result line's "best" and, when it stopped early, "early_stop"."""
        o = self.options
        if not (o.keep_best or o.early_stop):
            return {}
        out = {"best": keep_best.result(self.best, self._best_path)}
        if self._early_stop is not None:
            out["early_stop"] = {
                "step": self._early_stop[0],
                "steps_asked": self.total_steps,
                "evaluations": o.early_stop,
                "best_step": self.best.step,
            }
        return out

    def _id_limit_figures(self) -> dict:
        """The limits used, the stack inputs run in several passes and the ids dropped (all ranks);
        with --limits-out, each table's demand written as a limits file."""
        import torch

        from tpurec.dlrm import id_feedback

        o = self.options
        mine = id_feedback.summary(self.dmp)
        counts = torch.tensor([mine["multipass_batches"], mine["dropped_ids"]], dtype=torch.int64)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        out: dict[str, Any] = {
            "limits": o.id_limits,
            "multipass_batches": int(counts[0]),
            "dropped_ids": int(counts[1]),
        }
        demand, passes = id_feedback.merged(self.dmp, self.world)
        out["tables"] = id_feedback.per_table(demand, passes)
        for name, figures in out["tables"].items():
            self._metrics.add({"kind": "id_demand", "step": self.step_count, "table": name, **figures})
        if o.limits_out:
            kernels = id_feedback.every_kernel(self.dmp)
            layout = {
                "topology": self.emulated.spec.name if self.emulated else None,
                "world_size": self.world,
                "sparsecores_per_device": kernels[0].num_sc if kernels else 0,
                "batch_size_per_device": self.batch_size,
            }
            if self.rank == 0:
                with self._side_output():
                    zch = o.zch_spec()
                    doc = id_feedback.limits_document(
                        demand, layout, o.data or "synthetic", zch=zch.record() if zch is not None else None
                    )
                    id_feedback.write(o.limits_out, doc)
                    self.say(f"id limits seen in training written to {o.limits_out} ({len(demand)} tables)")
            out["limits_out"] = o.limits_out
        return out

    def _slice_figures(self) -> dict:
        """Hosts, and on the TPU path what TorchTPU compiles: measured by the emulation's stand-in of
        its ops; None on a real TPU (TorchTPU 0.2.0 exposes no count tpurec reads yet)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        out: dict = {"hosts": max(1, self.world // max(1, local))}
        if self.device == DeviceKind.TPU:
            out["uneven_all_to_all"] = getattr(self.dmp, "uneven_all_to_all", None)
        if self.emulated:
            from tpurec.sharding.tpu_all_to_all import padded_calls

            out.update(
                emulated_tpu=self.emulated.spec.name,
                padded_all_to_alls=padded_calls(),
                programs_compiled=self.emulated.programs_compiled(),
                recompiles_after_warmup=self.emulated.recompiles_after_warmup(),
                # Which ops recompiled, and how often: where a shape followed the data.
                recompiled_ops=dict(Counter(op for _, op, _ in self.emulated.late_programs()).most_common(10)),
                **self.emulated.graph_counts(),  # torch.compile graphs and graph breaks (0: an eager step)
            )
        elif self.device == DeviceKind.TPU:
            out.update(programs_compiled=None, recompiles_after_warmup=None)
        if self.device == DeviceKind.TPU:
            # tpurec's own device->host copies in the training steps (tpurec.runtime.host_copies): on an emulated
            # rank, of the tensors a real rank holds on its TPU.
            copies, steps = self._train_copies, self._steps_run
            if self.emulated:
                # Every copy off the emulated device (tpurec.emulation.device), by call site, in the steps
                # after warm-up; the warm-up's own (DDP's bucket rebuild in step 2) apart.
                copies, steps = Counter(self.emulated.train_copies()), max(0, self._steps_run - 2)
                out["device_to_host_copies_in_warmup"] = self.emulated.train_copies(steady=False)
            out["device_to_host_copies_per_step"] = round(sum(copies.values()) / max(1, steps), 4)
            out["device_to_host_copies"] = dict(sorted(copies.items()))
        return out

    # ---- the loop's pieces ----
    def _train_segment(self, end: int) -> None:
        """Steps up to `end`; the pipeline drains at the end (its batch source ends there)."""
        self._batches = _Cuttable(itertools.islice(self._stream, end - self.step_count))
        from tpurec.dlrm import id_feedback
        from tpurec.runtime import host_copies

        id_feedback.record(self.dmp, True)  # training batches only: evaluation's may differ in size
        batch, world = self.batch_size, self.world
        copies_before = host_copies.counts()
        t0 = mark = time.perf_counter()
        while (loss := self._advance()) is not None:
            self._steps_run += 1
            self._window_steps += 1
            self._loss_sum = loss if self._loss_n == 0 else self._loss_sum + loss  # summed where computed
            self._loss_n += 1
            if self.step_count % self._log_every == 0 or self.step_count == end:
                # samples/s of the steps since the last logged one (a running average hides a slowdown)
                now = time.perf_counter()
                self._window_seconds += now - mark
                mark = now
                secs, steps = self._window_seconds, self._window_steps
                sps = steps * batch * world / secs if secs > 0 else 0.0
                eta = (self.total_steps - self.step_count) * secs / steps if steps else 0.0
                self._window_seconds, self._window_steps = 0.0, 0
                # the same steps on every rank: where they agree to stop (the batches in flight drain)
                if not self._batches.cut and (signum := self._stop.agreed(world)):
                    self._stopping, self._batches.cut = signum, True
                mean = self._read_loss(self._loss_sum, self._loss_n)
                self._metrics.add(
                    {
                        "kind": "train",
                        "step": self.step_count,
                        "epoch": self._train_state()["epoch"],
                        "samples": self.samples,
                        "seconds": round(time.perf_counter() - self._t_start, 3),
                        "loss": mean,
                        "samples_per_s": round(sps, 1),
                        **self._remap_record(train=True),
                    }
                )
                self._bar.set_postfix_str(f"loss {mean:.4f}, {sps:,.0f} samples/s", refresh=False)
                if self._bar.disable and not self.options.quiet and self._crossed_tenth(end):
                    self.say(
                        f"step {self.step_count}/{self.total_steps}: loss {mean:.4f}, {sps:,.0f} samples/s, "
                        f"ETA {_clock(eta)}"
                    )
                self._loss_sum, self._loss_n = 0.0, 0
            self._bar.update(1)
        self._window_seconds += time.perf_counter() - mark
        self._train_seconds += time.perf_counter() - t0
        for what, n in host_copies.counts().items():
            self._train_copies[what] += n - copies_before.get(what, 0)
        id_feedback.record(self.dmp, False)
        if self.step_count < end and not self._stopping:  # the data ran out (an empty epoch); cannot continue
            raise RuntimeError(f"training data exhausted at step {self.step_count}")

    def _crossed_tenth(self, end: int) -> bool:
        """True once per tenth of the run: where a progress line goes when there is no bar."""
        tenth = self.step_count * 10 // max(1, self.total_steps)
        if tenth > getattr(self, "_last_tenth", -1):
            self._last_tenth = tenth
            return True
        return False

    def _log_eval(self, ev: dict) -> dict:
        self._metrics.add(
            {
                "kind": "eval",
                "step": self.step_count,
                "epoch": self._train_state()["epoch"],
                "samples": self.samples,
                "seconds": round(time.perf_counter() - self._t_start, 3),
                **ev,
                **self._remap_record(train=False),
            }
        )
        return ev

    def _remap_record(self, train: bool) -> dict:
        """--zch: the remap's figures for a metrics record (every rank calls it: a collective). Training:
        ids remapped so far, their hit rate, evictions so far, occupancy; eval: that evaluation's hit rate."""
        if self.remap is None:
            return {}
        f = self.remap.figures(self.world)
        return {
            "zch_remapped_ids": f["remapped_ids"] if train else f["eval_remapped_ids"],
            "zch_hit_rate": f["hit_rate"] if train else f["eval_hit_rate"],
            "zch_evictions": f["evictions"],
            "zch_occupancy": f["occupancy"],
        }

    def _remap_figures(self) -> dict:
        """--zch: the result line's remap figures (all ranks), each table's in --metrics-out."""
        assert self.remap is not None
        for name, t in self.remap.per_table(self.world).items():
            self._metrics.add(
                {
                    "kind": "zch_table",
                    "step": self.step_count,
                    "table": name,
                    "zch_remapped_ids": t["ids"],
                    "zch_hit_rate": round(t["hits"] / t["ids"], 6) if t["ids"] else None,
                    "zch_evictions": t["evictions"],
                    "zch_occupancy": t["occupancy"],
                }
            )
        return self.remap.figures(self.world)

    def _report(self, result: dict) -> None:
        self._write_curves()
        self.say(summary_text(result, self.data_dir))
        # One strict JSON line: a non-finite metric is null, never a bare NaN that JSON parsers refuse.
        # Short: each table's id demand (26 to hundreds of tables) goes to the metrics file's
        # id_demand rows and --limits-out, not into the line (run() still returns it).
        line = dict(result, id_limits={k: v for k, v in result["id_limits"].items() if k != "tables"})
        print(strict_json.dumps(line), flush=True)
        if self._output_failures:
            # after the result line: the training it reports finished; the run still fails (exit 2)
            raise UserError("; ".join(self._output_failures))

    def _write_curves(self) -> None:
        """The curves PNG, the metrics file's last write and TensorBoard's (rank 0); a file that
        cannot be written is kept in _output_failures, the others named in the log."""
        o = self.options
        png = o.curves_path(time.strftime("%Y%m%d-%H%M%S"))
        if png:
            from tpurec.dlrm.plots import plot_curves

            with self._side_output():
                plot_curves(
                    self._metrics.records,
                    png,
                    title=f"{self.model_name}, {self.world} rank(s), batch {self.batch_size}/rank",
                    oracle_auc=self.oracle_auc,
                    flag="--curves-out" if o.curves_out else "the curves PNG",
                )
        self._metrics.flush()
        if self._metrics.failure:
            self._output_failures.append(self._metrics.failure)
        tensorboard = self._metrics.tensorboard
        if tensorboard is not None:
            tensorboard.close()
            if tensorboard.failure:
                self._output_failures.append(tensorboard.failure)
        written = (("metrics", o.metrics_out, self._metrics.failure), ("curves", png, png and self._failed(png)))
        if any(v and not failed for _, v, failed in written):
            self.say(", ".join(f"{k}: {v}" for k, v, failed in written if v and not failed))

    @contextlib.contextmanager
    def _side_output(self) -> Iterator[None]:
        """A file written beside the training (plan, limits, curves): its failure (a UserError naming
        the path) is kept and reported after the result line, never ending the run before it."""
        try:
            yield
        except UserError as e:
            self._output_failures.append(str(e))

    def _failed(self, path: str) -> bool:
        return any(str(path) in f for f in self._output_failures)


class _Cuttable(Iterator["Batch"]):
    """A segment's batches that end early once `cut`: the pipeline then trains the batches it holds
    and stops, as at a segment's end, so the reader's position is that of the last batch trained."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self.cut = False

    def __next__(self) -> Batch:
        if self.cut:
            raise StopIteration
        return next(self._batches)


def _clock(seconds: float) -> str:
    """An ETA as H:MM:SS (M:SS under an hour), as tqdm shows it."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
