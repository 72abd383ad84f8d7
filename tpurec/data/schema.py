"""The Criteo-style Parquet schema and the metadata that travels with every file.

A dataset is a directory of Parquet files. Every file carries the same JSON document under the
Parquet key-value metadata key ``tpurec`` (column names, table sizes, the dense transform and the
categorical hashing that were applied), so a reader never has to guess what the numbers mean.
The directory also holds ``_dataset.json``: the same document plus dataset-wide facts known only at
the end of writing (total rows, files, and ``oracle_auc`` for synthetic data). The leading
underscore makes pyarrow, pandas, Spark and DuckDB skip it, so the directory opens in them as a
plain Parquet dataset (``dataset.json``, the name before 2026-12, is still read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.errors import UserError
from tpurec.json_fields import FieldError, choice, each, fields, flag, obj, optional, text
from tpurec.runtime import storage

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

FORMAT_VERSION = 1
METADATA_KEY = b"tpurec"
DATASET_JSON = "_dataset.json"
LEGACY_DATASET_JSON = "dataset.json"  # read, never written: other tools choke on it

# Transforms, recorded by name so a reader (or a person) knows what was applied.
DENSE_LOG1P = "log1p_clamp0"  # log(max(x, 0) + 1); empty -> 0
DENSE_RAW = "raw"  # the number as written; empty -> 0
DENSE_TORCHREC = "torchrec_log"  # log(x - m + 2), m the day file's smallest value (TorchRec's tsv_to_npys)
CAT_HASH = "mod_reserve0"  # empty -> 0; otherwise 1 + (int(hex, 16) mod (num_embeddings - 1))
CAT_RAW = "raw_hex"  # int(hex, 16); empty -> 0
CAT_MOD = "mod"  # v mod num_embeddings: TorchRec's `hashes`, what MLPerf's multi-hot files already hold
EMPTY_ID = 0  # the id every empty categorical becomes, in both modes


class DataError(UserError):
    """Bad input data: the message names the file (and row group / line, column when known)."""


@dataclass(frozen=True)
class SparseFeature:
    name: str  # Parquet column name and KJT key
    num_embeddings: int | None  # ids are in [0, num_embeddings); None when raw (unbounded)
    multi_hot: bool = False  # list<int> column instead of one int per row
    weights: str | None = None  # name of a list<float32> column of per-id weights, if any

    @property
    def rows(self) -> int:
        """The table size of a feature whose ids are bounded (hashed or mod ids always have one)."""
        assert self.num_embeddings is not None, f"feature {self.name!r}: raw ids have no table size"
        return self.num_embeddings


@dataclass
class DataSchema:
    label: str = "label"
    dense: list[str] = field(default_factory=lambda: [f"I{i}" for i in range(1, 14)])
    sparse: list[SparseFeature] = field(default_factory=list)
    dense_transform: str = DENSE_LOG1P
    categorical: str = CAT_HASH
    extra: dict = field(default_factory=dict)  # dataset-specific facts (table_set, source, ...)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def to_json(self) -> dict:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        d["empty_id"] = EMPTY_ID
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "tpurec metadata") -> DataSchema:
        """The schema of a metadata document; ``where`` (a file) names it in errors, with the JSON
        path of a field of the wrong kind (a hand-edited `_dataset.json`)."""
        try:
            obj("$", d)
            if d.get("format_version") != FORMAT_VERSION:
                raise DataError(f"{where}: unsupported tpurec data format_version {d.get('format_version')!r}")
            fields("$", d, _SCHEMA_CHECKS, required=_SCHEMA_REQUIRED)
        except FieldError as e:
            raise DataError(f"{where}: {e}") from None
        try:
            sparse = [SparseFeature(**f) for f in d["sparse"]]
            schema = cls(
                label=d["label"],
                dense=list(d["dense"]),
                sparse=sparse,
                dense_transform=d["dense_transform"],
                categorical=d["categorical"],
                extra=dict(d.get("extra") or {}),
            )
        except (KeyError, TypeError) as e:  # a field missing, unknown or of the wrong kind
            raise DataError(f"{where}: malformed tpurec metadata ({type(e).__name__}: {e})") from None
        for f in sparse:
            n = f.num_embeddings
            # bool is an int in Python; a table size of True is a damaged document, not 1 row.
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise DataError(f"{where}: feature {f.name!r}: num_embeddings {n!r} is not a table size (integer >= 1)")
        return schema

    def arrow_schema(self) -> pa.Schema:
        """The Parquet schema files with this layout have (ids as int64, dense as float32)."""
        import pyarrow as pa

        # List elements are declared non-null too: a list of nullable elements carries a definition
        # level per id, which pyarrow decodes with the ids (12-20% of a multi-hot row group's read
        # time, measured on the bench pipeline data); files written before still read the same.
        def items(t: pa.DataType) -> pa.DataType:
            return pa.list_(pa.field("element", t, nullable=False))

        fields = [pa.field(self.label, pa.int8(), nullable=False)]
        fields += [pa.field(n, pa.float32(), nullable=False) for n in self.dense]
        for f in self.sparse:
            t = items(pa.int64()) if f.multi_hot else pa.int64()
            fields.append(pa.field(f.name, t, nullable=False))
            if f.weights:
                fields.append(pa.field(f.weights, items(pa.float32()), nullable=False))
        return pa.schema(fields, metadata={METADATA_KEY: strict_json.dumps(self.to_json()).encode()})


def _sparse_feature(at: str, f: Any) -> None:
    """A `sparse` entry: SparseFeature's fields (num_embeddings is checked by feature, in from_json)."""
    checks = {"name": text, "multi_hot": flag, "weights": optional(text)}
    fields(at, obj(at, f, ("name", "num_embeddings", "multi_hot", "weights")), checks, ("name", "num_embeddings"))


# What DataSchema.from_json reads; the other fields of a document are facts (rows, seed, ...).
_SCHEMA_CHECKS = {
    "label": text,
    "dense": each(text),
    "sparse": each(_sparse_feature),
    "dense_transform": choice([DENSE_LOG1P, DENSE_RAW, DENSE_TORCHREC]),
    "categorical": choice([CAT_HASH, CAT_RAW, CAT_MOD]),
    "extra": optional(obj),
}
_SCHEMA_REQUIRED = ("label", "dense", "sparse", "dense_transform", "categorical")


def criteo_schema(
    table_sizes: list[int] | None = None,
    *,
    dense_names: list[str] | None = None,
    sparse_names: list[str] | None = None,
    label: str = "label",
    multi_hot: list[bool] | None = None,
    dense_transform: str = DENSE_LOG1P,
    categorical: str = CAT_HASH,
) -> DataSchema:
    """The Criteo layout: label, 13 dense, 26 categorical, with Merlin/HugeCTR names by default.

    ``dense_names``/``sparse_names`` rename columns (e.g. torchrec's ``int_0..``/``cat_0..``).
    ``table_sizes`` defaults to the Criteo Kaggle vocabulary sizes (tpurec/data/catalog.py).
    """
    from tpurec.data.catalog import CRITEO_KAGGLE_ROWS, FEATURE_NAMES

    dense_names = dense_names or [f"I{i}" for i in range(1, 14)]
    sparse_names = sparse_names or list(FEATURE_NAMES)
    sizes = list(table_sizes or CRITEO_KAGGLE_ROWS)
    if len(sizes) != len(sparse_names):
        raise UserError(f"{len(sizes)} table sizes for {len(sparse_names)} categorical columns")
    if categorical == CAT_HASH and min(sizes) < 2:
        raise UserError("hashed tables need num_embeddings >= 2 (id 0 is reserved for empty)")
    mh = multi_hot or [False] * len(sparse_names)
    sparse = [
        SparseFeature(n, None if categorical == CAT_RAW else int(s), bool(m))
        for n, s, m in zip(sparse_names, sizes, mh)
    ]
    return DataSchema(label, list(dense_names), sparse, dense_transform, categorical)


def list_parquet_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A directory (all ``*.parquet`` in it, sorted) or a list of files/directories; local paths
    or bucket URIs (tpurec/runtime/storage.py)."""
    if isinstance(paths, (str, os.PathLike, storage.BucketPath)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        p = storage.path(p)
        if p.is_dir():
            out += sorted(str(f) for f in p.glob("*.parquet"))
        elif p.exists():
            out.append(str(p))
        else:
            raise DataError(f"{p}: {p.missing_reason() if storage.is_uri(p) else 'no such file or directory'}")
    if not out:
        raise DataError(f"no .parquet files in {', '.join(map(str, paths))}")
    return out


def unread_files(path: str | os.PathLike) -> list[str]:
    """The files in tpurec's dataset directory `path` its reader leaves out, sorted: those not named
    ``*.parquet`` (a part renamed ``.snappy``, a README), except ``_``/``.`` names (``_dataset.json``,
    ``_SUCCESS``, lock files): said once (`unread_note`), never read in silence."""
    p = storage.path(path)
    if not p.is_dir():
        return []
    return sorted(f.name for f in p.glob("*") if not f.name.startswith(("_", ".")) and f.suffix != ".parquet")


def unread_note(path: str | os.PathLike, names: Sequence[str], why: str) -> str | None:
    """One notice line for the files a dataset's reader skipped (`names`): the count and an example."""
    if not names:
        return None
    return f"notice: {path}: {len(names):,} file(s) not read, {why} (e.g. {names[0]})"


def read_footer(path: str) -> pq.FileMetaData:
    """One Parquet file's footer (a local file, or an object in a bucket: tpurec/runtime/storage.py)."""
    import pyarrow.parquet as pq

    fs, where = storage.arrow(path)
    try:
        return pq.read_metadata(where, filesystem=fs)
    except UserError:  # the bucket refused: its own line
        raise
    except Exception as e:  # truncated / not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def read_file_schema(path: str, meta: pq.FileMetaData | None = None) -> DataSchema:
    """The DataSchema recorded in one Parquet file's footer (`meta`, when already read)."""
    if meta is None:
        meta = read_footer(path)
    raw = (meta.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise DataError(f"{path}: no tpurec metadata in the Parquet footer (not written by tpurec data?)")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's parser reads
        raise DataError(f"{path}: the tpurec metadata in the Parquet footer is not JSON ({_json_problem(e)})") from None
    return DataSchema.from_json(doc, where=path)


def dataset_metadata(path: str | os.PathLike) -> dict:
    """Everything recorded about a dataset: schema, transforms, table sizes, rows, ``oracle_auc``.

    ``path`` is the dataset directory (reads ``_dataset.json``; falls back to the first file's footer)
    or a Parquet file.
    """
    p = storage.path(path)
    found = dataset_json(p) if p.is_dir() else None
    first = list_parquet_files([p])[0]
    if found is None:
        return read_file_schema(first).to_json()
    try:
        doc = json.loads(found.read_text())
    except (ValueError, RecursionError) as e:  # a truncated or hand-edited file
        raise DataError(
            f"{found}: not JSON ({_json_problem(e)}); delete it to use the Parquet footers' metadata"
        ) from None
    check_table_sizes(found, doc, read_file_schema(first), first)
    return doc


def _json_problem(e: Exception) -> str:
    return "nested deeper than Python's JSON parser reads" if isinstance(e, RecursionError) else str(e)


def check_table_sizes(where: object, doc: dict, footer: DataSchema, footer_file: str) -> None:
    """``_dataset.json``'s table sizes must be the ones the files were written for: the model's
    tables are built from this document, the reader checks ids against the footers."""
    from_doc = DataSchema.from_json(doc, where=str(where))
    sizes = doc.get("table_sizes")
    for f in from_doc.sparse:
        if isinstance(sizes, dict) and sizes.get(f.name, f.num_embeddings) != f.num_embeddings:
            raise DataError(
                f"{where}: feature {f.name!r}: table_sizes says {sizes[f.name]}, its sparse list says "
                f"{f.num_embeddings}; the file was edited or damaged: rewrite it (tpurec data convert/synth)"
            )
    theirs = {f.name: f.num_embeddings for f in footer.sparse}
    for f in from_doc.sparse:
        if f.name not in theirs:
            raise DataError(f"{where}: feature {f.name!r} is not in {footer_file}; the files are another dataset's")
        if theirs[f.name] != f.num_embeddings:
            raise DataError(
                f"{where}: feature {f.name!r}: table size {f.num_embeddings}, but {footer_file} was written for "
                f"{theirs[f.name]}; the file does not belong to these Parquet files: rewrite or delete it"
            )


def dataset_json(directory: str | os.PathLike) -> Path | None:
    """The dataset's metadata file (``_dataset.json``, or the older ``dataset.json``), if written
    (a `storage.BucketPath` in a bucket)."""
    for name in (DATASET_JSON, LEGACY_DATASET_JSON):
        if (storage.path(directory) / name).is_file():
            return storage.path(directory) / name
    return None


def prepare_output_dir(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Create `out_dir`; refuse if it already holds Parquet files, unless `overwrite`. Nothing is
    removed here: the old dataset stays whole until the new one is written (`remove_stale_parts`),
    so a conversion that fails leaves the previous data and its _dataset.json as they were."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob("*.parquet"))
    if existing and not overwrite:
        raise DataError(f"{out_dir} already holds {len(existing)} .parquet files; use --overwrite")
    return out


def remove_stale_parts(out_dir: str | os.PathLike, written: Iterable[str | os.PathLike]) -> None:
    """After a successful write: remove the .parquet files of `out_dir` that are not in `written`."""
    keep = {Path(f).name for f in written}
    for f in Path(out_dir).glob("*.parquet"):
        if f.name not in keep:
            f.unlink()


def parquet_writer(path: str | os.PathLike, arrow_schema: pa.Schema, compression: str) -> pq.ParquetWriter:
    """A ParquetWriter for tpurec files: CRC32 checksums on every page, so the reader
    (``page_checksum_verification``) finds a damaged page instead of decoding garbage ids."""
    import pyarrow.parquet as pq

    return pq.ParquetWriter(path, arrow_schema, compression=compression, write_page_checksum=True)


def write_dataset_json(out_dir: str | os.PathLike, schema: DataSchema, **facts: Any) -> dict:
    d = schema.to_json()
    d.update(facts)
    d["table_sizes"] = {f.name: f.num_embeddings for f in schema.sparse}
    tmp = Path(out_dir) / f"{DATASET_JSON}.tmp-{os.getpid()}"
    tmp.write_text(strict_json.dumps(d, indent=2) + "\n")
    tmp.replace(Path(out_dir) / DATASET_JSON)
    (Path(out_dir) / LEGACY_DATASET_JSON).unlink(missing_ok=True)  # an older dataset's, now replaced
    return d
