"""Training data for `tpurec train`: the default synthetic dataset (made once, cached) and the
train / eval readers over a dataset directory.

Only tpurec.data's public API is used (synthesize, dataset_metadata, split_train_eval,
ParquetReader); what the trainer adds is: a cache dir, batch capping for tiny data, and eval readers
that give every rank the same number of batches (collectives need it).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch

    from tpurec.data.mapped import MappedSource
    from tpurec.data.mapping import ColumnSpec
    from tpurec.data.reader import ParquetReader
    from tpurec.data.shards import Unit

log = logging.getLogger("tpurec.train")


def cache_root() -> Path:
    return Path(os.environ.get("TPUREC_CACHE", Path.home() / ".cache" / "tpurec"))


def synth_dir(table_set: str, rows: int, seed: int, multi_hot: list[int] | None = None) -> Path:
    """The cache directory of one synthetic dataset (other --multi-hot-sizes: another directory)."""
    tag = "" if multi_hot is None else "-mh" + "_".join(map(str, multi_hot))
    return cache_root() / f"synth-{table_set}-{rows}-{seed}{tag}"


def synth_cache_problem(table_set: str, rows: int, seed: int, multi_hot: list[int] | None = None) -> str | None:
    """Why this synthetic dataset cannot be made in the cache (one line naming TPUREC_CACHE), or None:
    it is there already, or the cache can be written."""
    if (synth_dir(table_set, rows, seed, multi_hot) / "_dataset.json").is_file():
        return None
    from tpurec.data.synth_bounds import rows_problem
    from tpurec.outputs import output_problem

    return output_problem("TPUREC_CACHE", cache_root(), "dir") or rows_problem(
        "--synth-rows", rows, cache_root(), table_set, multi_hot
    )


def ensure_synth(
    table_set: str, rows: int, seed: int, say: Callable[[str], object] = print, multi_hot: list[int] | None = None
) -> Path:
    """The cached synthetic dataset, generated on first use.

    Race-safe: it is written into a fresh temporary directory beside the cache entry and renamed
    into place whole (``rename`` is atomic), so two runs starting together each see either no
    dataset or a complete one. Both may generate it; the first rename wins and the other run uses
    that copy (the same seed gives the same rows) and removes its own."""
    import shutil
    import tempfile

    from tpurec.data.leftovers import remove_stale_tmp_dirs
    from tpurec.data.schema import dataset_json
    from tpurec.runtime.terminate import unwinding_on_sigterm

    out = synth_dir(table_set, rows, seed, multi_hot)
    hots = "" if multi_hot is None else f", multi-hot {','.join(map(str, multi_hot))}"
    if dataset_json(out) is not None:
        say(f"data: synthetic {table_set}{hots}, {rows:,} rows, seed {seed}, cached in {out}")
        return out
    say(f"data: generating synthetic {table_set} data{hots} ({rows:,} rows, seed {seed}) once into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_dirs(out.parent, lambda line: say(f"data: {line}"))  # a killed run's (tpurec/data/leftovers.py)
    # SIGTERM, too, removes the temporary directory, in one line (tpurec/runtime/terminate.py)
    with unwinding_on_sigterm("tpurec train"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # same filesystem: rename works
        tmp.chmod(0o755)  # mkdtemp's 0700 would become the cache entry's mode
        try:
            _synthesize(tmp, table_set, rows, seed, multi_hot)
            _publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; ours when another run won
    return out


def _synthesize(out: Path, table_set: str, rows: int, seed: int, multi_hot: list[int] | None) -> None:
    from tpurec.data.synth import synthesize

    # Small row groups: more units to shuffle and to spread over ranks.
    synthesize(
        rows,
        str(out),
        seed=seed,
        table_set=table_set,
        row_group_size=16384,
        show_progress=False,
        overwrite=True,
        multi_hot_sizes=multi_hot,
    )


def _publish(tmp: Path, out: Path) -> None:
    """Rename the complete dataset ``tmp`` to ``out``, unless another run put a complete one there."""
    import errno
    import shutil

    from tpurec.data.schema import dataset_json

    for _ in range(3):
        try:
            os.rename(tmp, out)  # replaces an empty directory; fails on a non-empty one
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if dataset_json(out) is not None:
            return  # another run finished first
        # A partial directory (written in place by tpurec before 2026-12, then interrupted):
        # moved aside by one rename, so two runs cannot both remove it.
        aside = tmp.with_name(tmp.name + ".stale")
        try:
            os.rename(out, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"{out}: could not put the synthetic dataset in place (another process keeps writing there)")


@dataclass
class Readers:
    train: ParquetReader
    eval: ParquetReader
    batch_size: int  # per rank, after capping
    eval_rows: int  # this rank's real eval rows (the last eval batch may be padded past them)
    table_sizes: list[int]


def make_readers(
    data_dir: str | os.PathLike,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    seed: int,
    eval_fraction: float,
    table_sizes: list[int],
    eval_batch_size: int = 4096,
    warn: Callable[[str], object] = log.warning,
    keep_raw_ids: bool = False,
    columns: ColumnSpec | None = None,
    remap_ranges: dict[str, int] | None = None,
    dense_log1p: bool = False,
) -> Readers:
    """The train and eval readers. Raw ids are hashed into `table_sizes` at read time unless
    `keep_raw_ids` (`tpurec train --zch`: TorchRec's remap takes them as they are); ``columns``: the
    column mapping of Parquet tpurec did not write (tpurec/data/mapping.py; inferred when None and the
    data has no tpurec metadata); ``remap_ranges``: features of a managed-collision table, whose raw ids
    are kept (below the remap's range, which `table_sizes` gives for them; ParquetReader); ``dense_log1p``:
    every dense value read as log(1 + max(x, 0)) (`--dense-transform log1p`: raw dense columns only)."""
    from tpurec.data.reader import ParquetReader, default_decode_threads
    from tpurec.data.schema import DENSE_LOG1P
    from tpurec.data.shards import split_train_eval

    source = data_source(data_dir, columns)
    meta = data_metadata(data_dir, columns)
    raw_ids = any(f.get("num_embeddings") is None for f in meta.get("sparse", []))
    sizes = table_sizes if raw_ids and not keep_raw_ids else None  # hash raw ids into the model's tables
    train_units, eval_units = split_train_eval(data_dir, eval_fraction, source=source)
    common: dict[str, Any] = dict(
        rank=rank, world_size=world_size, table_sizes=sizes, source=source, remap_ranges=remap_ranges
    )
    if dense_log1p:
        common["dense_transform"] = DENSE_LOG1P
    # the training reader decodes on several threads where the host has cores to spare (a TPU VM)
    train_opts: dict[str, Any] = dict(shuffle=True, seed=seed, drop_last=True, equal_rows=True)
    train_opts["decode_threads"] = default_decode_threads()
    train = ParquetReader(train_units, batch_size, **train_opts, **common)
    if train.num_rows < batch_size:
        # Fewer rows per rank than a batch: cap the batch so at least one full step exists.
        warn(
            f"only {train.num_rows} training rows per rank, fewer than --batch-size {batch_size}: "
            f"capping the batch at {train.num_rows}"
        )
        batch_size = train.num_rows
        train = ParquetReader(train_units, batch_size, **train_opts, **common)
    # Eval: every row of the split, so ranks may hold different row counts; eval_batches() tops the
    # shorter ranks up with empty batches so all run the same number of forward passes. Decoded
    # ahead as the training reader is (a forward pass no longer waits on Parquet decoding).
    ev = ParquetReader(
        eval_units,
        min(eval_batch_size, max(1, _eval_rows(eval_units, world_size))),
        pad_last=True,
        decode_threads=train_opts["decode_threads"],
        **common,
    )
    # every size is known: the dataset's, or raw ids hashed into (or remapped to) the model's tables
    known = list(table_sizes) if keep_raw_ids else cast(list[int], list(train.table_sizes))
    return Readers(train, ev, batch_size, ev.num_rows, known)


def eval_batches(reader: ParquetReader) -> Iterator[Batch]:
    """The eval reader's batches, then empty (all-padding) batches up to the largest rank's count.

    Collective forwards (embedding all-to-all) need every rank in every step; the padding rows are
    cut off afterwards (they come after this rank's `num_rows` real rows)."""
    import torch
    import torch.distributed as dist

    n = len(reader)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        most = int(t.item())
    else:
        most = n
    reader.set_epoch(0)
    yield from reader
    for _ in range(most - n):
        yield _empty_batch(reader)


def _empty_batch(reader: ParquetReader) -> Batch:
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b = reader.batch_size
    keys = reader.keys
    kjt = KeyedJaggedTensor(
        keys=keys, values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(len(keys) * b, dtype=torch.int32)
    )
    return Batch(dense_features=torch.zeros(b, len(reader.schema.dense)), sparse_features=kjt, labels=torch.zeros(b))


def _eval_rows(units: list[Unit], world_size: int) -> int:
    return sum(u.rows for u in units) // world_size


def data_source(data_dir: str | os.PathLike, columns: ColumnSpec | None = None) -> MappedSource | None:
    """The mapped source of Parquet tpurec did not write (or read with a mapping); None: tpurec's own."""
    return _data_source(str(data_dir), columns)


@functools.lru_cache(maxsize=4)  # the trainer asks several times; the scan reads every file's footer
def _data_source(data_dir: str, columns: ColumnSpec | None) -> MappedSource | None:
    from tpurec.data.mapped import open_source

    return open_source(data_dir, columns)


def data_metadata(data_dir: str | os.PathLike, columns: ColumnSpec | None = None) -> dict:
    """`tpurec.data.schema.dataset_metadata` of tpurec's data, or the same facts of mapped Parquet."""
    from tpurec.data.schema import dataset_metadata

    source = data_source(data_dir, columns)
    return source.metadata() if source is not None else dataset_metadata(data_dir)


def model_table_sizes(
    data_dir: str | os.PathLike, table_set_sizes: list[int], columns: ColumnSpec | None = None
) -> list[int]:
    """The table sizes the data's ids index into, one per sparse feature of the data (the converter/synth
    records them, or --sparse NAME:ROWS); for raw ids and mapped features without ROWS, the model's own
    sizes by position (the reader hashes into them). Data with another number of features than the
    model's table set gets a model of its shape (`build_model`); a feature past the table set's count
    needs its own size."""
    meta = data_metadata(data_dir, columns)
    sparse = meta.get("sparse", [])
    if not sparse:
        raise UserError(f"{data_dir}: no sparse (id) columns; the DLRM needs at least one")
    out = []
    for i, f in enumerate(sparse):
        if f.get("num_embeddings") is not None:
            out.append(int(f["num_embeddings"]))
        elif i < len(table_set_sizes):
            out.append(table_set_sizes[i])
        else:
            how = "--sparse NAME:ROWS" if "mapping" in meta else "convert it with table sizes"
            raise UserError(
                f"{data_dir}: sparse column {f['name']!r} (number {i + 1}) has no table size and the model's table set "
                f"has {len(table_set_sizes)} tables: give it one ({how})"
            )
    return out


def model_num_dense(data_dir: str | os.PathLike, columns: ColumnSpec | None = None) -> int:
    """The dense features the model takes: the data's."""
    return len(data_metadata(data_dir, columns).get("dense") or [])
