"""A rank's training data: where it is, what it holds, its readers, the stream of training batches
(prepared ahead, `tpurec.dlrm.input_pipeline`), the eval batches, and the reader position a
checkpoint records and a resume restores.

Setup follows the data: the table sizes, the dense feature count and the batch a rank trains come
from it (`TrainingData.setup`), so the model is built after it.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tpurec.dlrm.options import OPTIONS_ENV
from tpurec.dlrm.rank_setup import check_host_memory, log
from tpurec.dlrm.report import MIN_EVAL_ROWS_FOR_AUC, noisy_auc_text
from tpurec.errors import UserError
from tpurec.runtime import storage
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torch import nn
    from torchrec.datasets.utils import Batch

    from tpurec.data.prefetch import Prefetcher
    from tpurec.data.reader import ParquetReader
    from tpurec.dlrm.ckpt.manager import CheckpointManager
    from tpurec.dlrm.data import Readers
    from tpurec.dlrm.training.rank_run import RankRun
    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag


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


class Segment(Iterator["Batch"]):
    """A segment's batches that end early once `cut`: the pipeline then trains the batches it holds
    and stops, as at a segment's end, so the reader's position is that of the last batch trained."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self.cut = False

    def __next__(self) -> Batch:
        if self.cut:
            raise StopIteration
        return next(self._batches)


class TrainingData:
    """After `setup()`: `data_dir`, `table_sizes`, `feature_names`, `num_dense`, `readers`, `batch_size`
    (per rank), `total_steps`, `oracle_auc`; after `start_stream()`: `stream`, `prefetch`, `lookups`."""

    def __init__(self, run: RankRun) -> None:
        self.run = run
        self.stream: Iterator[Batch] = iter(())
        self.prefetch: Prefetcher | None = None
        self.lookups: list[SparseCoreEmbeddingBag] = []  # whose inputs the prefetcher builds ahead

    def check_memory(self) -> None:
        """Before any data is generated or read: a refusal in one line, not an OOM kill minutes in."""
        run, o = self.run, self.run.options
        if not run.emulation.tables_in_host_memory(run.device):
            return
        if run.user is not None:
            assert o.model_module is not None  # the user's model comes from it
            rows, dims = [t.num_embeddings for t in run.user.tables], [t.embedding_dim for t in run.user.tables]
            check_host_memory(run.cfg, rows, run.world, user=(o.model_module, dims, run.table_optimizer()))
        else:
            sizes, source = self.table_sizes_and_source()
            check_host_memory(run.cfg, sizes, run.world, source)

    def table_sizes_and_source(self) -> tuple[list[int], str]:
        """The table sizes training will build, and where they come from (for messages)."""
        from tpurec.dlrm.data import model_table_sizes

        o = self.run.options
        defaults = [t.num_embeddings for t in self.run.table_set.tables]
        if not o.data:
            return defaults, ""  # the synthetic data is made for the table set's own sizes
        sizes = model_table_sizes(o.data, defaults, o.column_spec())
        if sizes == defaults:
            return sizes, ""
        return sizes, f", sizes from {o.data}'s _dataset.json, not the {self.run.cfg.table_set} defaults"

    def setup(self) -> None:
        from tpurec.dlrm.data import data_metadata

        self.data_dir = self._locate()
        self.columns = self.run.options.column_spec()  # the column mapping of Parquet tpurec did not write
        meta = data_metadata(self.data_dir, self.columns)
        self._say_notes(meta)
        self._size_tables(meta)
        self.feature_names = [f["name"] for f in meta.get("sparse", [])]
        from tpurec.dlrm.host_tier import table_names

        # tables on the host tier (--host-tier's, or --plan's cache_params): the eval batch follows
        self.host_tier_tables: list[str] = table_names(self.run.options.host_tier, self.run.options.plan)
        self.num_dense = len(meta.get("dense") or [])  # the model takes the data's dense features
        if not self.num_dense and self.run.user is None:
            raise UserError(f"{self.data_dir}: no dense columns; the DLRM's bottom MLP needs at least one")
        self.readers = self._readers()
        self._size_run(meta)

    def _locate(self) -> Any:
        """--data (a Path, or a bucket's), or the synthetic data, written once per host."""
        import torch.distributed as dist

        from tpurec.dlrm.configs import synth_multi_hot
        from tpurec.dlrm.data import ensure_synth, synth_dir

        run, cfg = self.run, self.run.cfg
        if run.options.data:
            data_dir = storage.path(run.options.data)
        else:
            local_rank = int(os.environ.get("LOCAL_RANK", run.rank))
            if local_rank == 0:  # one writer per host; the others wait at the barrier
                # Under the --nproc launcher (options in OPTIONS_ENV) it made the data and said so.
                launched = OPTIONS_ENV in os.environ
                quiet = (lambda m: None) if launched else run.say
                ensure_synth(cfg.table_set, cfg.synth_rows, cfg.seed, say=quiet, multi_hot=synth_multi_hot(cfg))
            if run.world > 1:
                dist.barrier()
            data_dir = synth_dir(cfg.table_set, cfg.synth_rows, cfg.seed, synth_multi_hot(cfg))
        if run.options.zch:
            from tpurec.dlrm.zch import data_problem

            problem = data_problem(str(data_dir))
            if problem:
                raise UserError(problem)
        return data_dir

    def _say_notes(self, meta: dict) -> None:
        from tpurec.data.mapped import large_dense_note, mapping_summary, unread_files_note

        say, o = self.run.say, self.run.options
        unread = unread_files_note(self.data_dir, meta)
        if unread:
            say(unread)
        if "mapping" in meta:
            say(f"data: {self.data_dir}: Parquet read through a column mapping: {mapping_summary(meta)}")
            large = None if o.dense_transform else large_dense_note(meta)
            if large:
                say(large)
        if o.dense_transform:
            say("data: every dense column read as log(1 + max(x, 0)) (--dense-transform log1p)")

    def _size_tables(self, meta: dict) -> None:
        from tpurec.data.mapped import unsized_note
        from tpurec.dlrm.data import model_table_sizes

        run, cfg = self.run, self.run.cfg
        defaults = [t.num_embeddings for t in run.table_set.tables]
        if run.user is not None:  # each column's table: the model's (tpurec.dlrm.user_model)
            from tpurec.dlrm.user_model import data_table_sizes

            self.table_sizes = defaults = data_table_sizes(run.user, meta, str(self.data_dir))
        else:
            self.table_sizes = model_table_sizes(self.data_dir, defaults, self.columns)
            note = unsized_note(meta, self.table_sizes, cfg.table_set)
            if note:
                run.say(note)
        if self.table_sizes != defaults:
            mapped = "mapping" in meta  # sizes from --sparse NAME:ROWS (or --columns)
            run.say(
                f"tables: sizes from {self.data_dir}'s {'column mapping' if mapped else '_dataset.json'}: "
                f"{sum(self.table_sizes):,} rows in all (the {cfg.table_set} defaults have {sum(defaults):,})"
                + ("" if mapped else f"; convert with --table-set {cfg.table_set} to train the model's own sizes")
            )

    def _readers(self) -> Readers:
        from tpurec.dlrm.data import make_readers

        run, cfg, o = self.run, self.run.cfg, self.run.options
        return make_readers(
            self.data_dir,
            cfg.batch_size,
            run.rank,
            run.world,
            seed=cfg.seed,
            eval_fraction=cfg.eval_fraction,
            table_sizes=self.table_sizes,
            warn=log.warning if run.rank == 0 else (lambda *a: None),
            keep_raw_ids=o.zch,  # --zch: TorchRec's remap takes the raw ids
            columns=self.columns,
            # a --model-module's managed-collision tables: so do their remaps (tpurec.dlrm.user_model)
            remap_ranges=run.user.remap_ranges() if run.user is not None else None,
            dense_log1p=o.dense_transform == "log1p",
            # Eval at the training batch: on a TPU, its lookup program and id limits (every shape is compiled
            # in); with the host tier, its caches (sized for the training batch's rows, --host-tier).
            **({"eval_batch_size": cfg.batch_size} if run.device == DeviceKind.TPU or self.host_tier_tables else {}),
        )

    def _size_run(self, meta: dict) -> None:
        """The batch a rank trains, the steps of the run, and the line that says them."""
        run, cfg, world = self.run, self.run.cfg, self.run.world
        self.batch_size = batch = self.readers.batch_size
        if batch != cfg.batch_size:
            from tpurec.dlrm.configs import override

            # Capped to the rows a rank holds: the model is planned (and its memory checked) for
            # the batch it trains, not the one asked for.
            run.cfg = cfg = override(cfg, batch_size=batch)
        steps_per_epoch = len(self.readers.train)
        self.total_steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
        self.oracle_auc = oracle = meta.get("oracle_auc")
        run.say(
            f"data: {self.data_dir}: {meta.get('rows', '?'):,} rows; per rank {self.readers.train.num_rows:,} "
            f"train / {self.readers.eval_rows:,} eval rows; {steps_per_epoch} steps per epoch of global batch "
            f"{batch * world:,}" + (f"; oracle AUC {oracle:.4f}" if oracle else "")
        )
        eval_rows = self.readers.eval_rows * world  # about: ranks may hold a row more or less
        if eval_rows < MIN_EVAL_ROWS_FOR_AUC and run.rank == 0:
            log.warning(noisy_auc_text(eval_rows))

    def start_stream(self, dmp: nn.Module) -> None:
        """The training batches, prepared `--pipeline-depth` ahead in background threads (with the
        CSR inputs on one rank, `tpurec.dlrm.input_pipeline`), or read inline at depth 0."""
        from tpurec.dlrm.input_pipeline import lookups_to_prepare, make_prefetcher

        run, o = self.run, self.run.options
        self.lookups = lookups_to_prepare(dmp, run.world) if o.pipeline_depth and not run.remapped() else []
        self.prefetch = make_prefetcher(
            self.readers.train, self.lookups, depth=o.pipeline_depth, workers=o.pipeline_workers
        )
        self.stream = iter(self.prefetch) if self.prefetch is not None else endless(self.readers.train)
        if run.device == DeviceKind.TPU:
            from tpurec.data.host_ids import keep_ids_on_host

            # Only dense features and labels go to the TPU; the ids stay on the host for the input
            # all-to-all and SparseCore preprocessing (tpurec.data.host_ids).
            self.stream = map(keep_ids_on_host, self.stream)

    def segment(self, steps: int) -> Segment:
        """The next `steps` training batches (fewer if the data runs out or the segment is cut)."""
        return Segment(itertools.islice(self.stream, steps))

    def train_state(self) -> dict:
        """The reader's position after the last batch the step took (not the batches read ahead)."""
        return self.prefetch.state_dict() if self.prefetch is not None else self.readers.train.state_dict()

    def eval_batches(self) -> Iterator[Batch]:
        """The whole eval split, its last batch padded (tpurec.dlrm.data.eval_batches)."""
        from tpurec.dlrm.data import eval_batches

        it = eval_batches(self.readers.eval)
        if self.run.device == DeviceKind.TPU:
            from tpurec.data.host_ids import keep_ids_on_host

            it = map(keep_ids_on_host, it)
        return it

    def restore(self, cmeta: dict, state: dict | None, checkpointer: CheckpointManager) -> str:
        """The reader's position of a resumed checkpoint (`state`: its own, at the same world size);
        how exact it is, for the resume line."""
        train = self.readers.train
        if state is not None:
            checkpointer.restore(state, train)
            return "exact (same world size)"
        # Another world size: rows are dealt out differently, so continue at the same epoch and
        # the same fraction of it (rows near the cut may be seen twice or skipped in that epoch).
        st = train.state_dict()
        frac = float(cmeta["epoch_fraction"])
        st.update(epoch=cmeta["epoch"], rows_consumed=position_in_epoch(frac, train.num_rows, self.batch_size))
        train.load_state_dict(st)
        return (
            f"at world size {self.run.world} from {cmeta['world_size']}: data position approximate "
            f"(epoch {st['epoch']}, {frac:.1%} through it)"
        )

    def close(self) -> None:
        """The batches read ahead that training will not take: dropped, the threads stopped."""
        if self.prefetch is not None:
            self.prefetch.close()
        for m in self.lookups:
            m.clear_prepared()
