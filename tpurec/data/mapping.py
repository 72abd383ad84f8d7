"""The column mapping of Parquet files tpurec did not write: which column is the label, which are dense,
which are sparse (and their table sizes).

Given on the command line (``--label COL --dense COL,... --sparse NAME[:ROWS],...``, globs allowed),
in a small YAML or JSON file (``--columns FILE``, the format ``ColumnMapping.to_yaml`` prints), or
inferred from the Parquet schema: a column named label/click/clicked/target/y is the label, other
float (and bool) columns are dense, integer, string and ``list<int|string>`` columns are sparse;
partition columns (``day=3/`` directories) and columns of other types are left out unless named. So are
the other label-named columns when the data has several (``label`` and ``clicked``): inferred as features
they would hand the model the answer (AUC 1.0 after a few steps); `label_like` names them.
A part not given (e.g. only ``--label``) is inferred from the columns the given parts leave.

Every problem is one line (UserError) naming the column.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.errors import UserError

if TYPE_CHECKING:
    import argparse

    import pyarrow as pa

LABEL_NAMES = ("label", "click", "clicked", "target", "y")  # inferred label, case-insensitive
INT, STRING, INT_LIST, STRING_LIST = "int", "string", "int_list", "string_list"  # sparse column kinds


class MappingError(UserError):
    """A mapping that does not fit the data: one line naming the column."""


@dataclass(frozen=True)
class ColumnSpec:
    """What the user gave: flags (comma-separated text, as typed) and/or a mapping file."""

    label: str | None = None
    dense: str | None = None
    sparse: str | None = None
    file: str | None = None

    def given(self) -> bool:
        return any(x is not None for x in (self.label, self.dense, self.sparse, self.file))


@dataclass(frozen=True)
class SparseColumn:
    name: str
    rows: int | None  # table size to hash into; None: the model's table size for this feature
    kind: str  # INT, STRING, INT_LIST or STRING_LIST

    @property
    def multi_hot(self) -> bool:
        return self.kind in (INT_LIST, STRING_LIST)


@dataclass(frozen=True)
class ColumnMapping:
    label: str
    dense: list[str]
    sparse: list[SparseColumn]
    inferred: tuple[str, ...] = ()  # the parts inferred ("label", "dense", "sparse")
    skipped: tuple[str, ...] = ()  # columns left out by inference (other types, partition columns)
    label_like: tuple[str, ...] = ()  # of `skipped`: other label-named columns, never inferred as features

    def to_doc(self) -> dict:
        """The mapping file's document: {label, dense: [...], sparse: {name: rows or null}}."""
        return {"label": self.label, "dense": list(self.dense), "sparse": {f.name: f.rows for f in self.sparse}}

    def to_yaml(self) -> str:
        """The mapping as a file for ``--columns`` (YAML; also readable by any YAML parser)."""
        lines = ["# tpurec column mapping: tpurec train|data inspect|data stats|data convert --columns FILE"]
        if self.inferred:
            lines.append(f"# inferred: {', '.join(self.inferred)}; edit and save to fix it")
        lines.append(f"label: {strict_json.dumps(self.label)}")
        lines.append("dense: [" + ", ".join(strict_json.dumps(n) for n in self.dense) + "]")
        lines.append("sparse:  # column: table rows (null: the model's table size; ids hashed into it)")
        for f in self.sparse:
            lines.append(f"  {strict_json.dumps(f.name)}: {'null' if f.rows is None else f.rows}  # {f.kind}")
        if not self.sparse:
            lines[-1] = "sparse: {}"
        if self.skipped:
            lines.append(f"# left out: {', '.join(self.skipped)}")
        if self.label_like:
            lines.append(f"# {self.label_like_note()}")
        return "\n".join(lines) + "\n"

    def label_like_note(self) -> str:
        """The line naming the label-named columns left out of the features (empty when none)."""
        if not self.label_like:
            return ""
        return (
            f"label {self.label!r} chosen; also label-named and left out of the features: "
            f"{', '.join(self.label_like)} (name one with --label, or as a feature with --dense/--sparse)"
        )


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The mapping flags of `tpurec data inspect` / `data stats` (`tpurec train` has them as TrainOptions fields)."""
    for name, metavar, text in FLAGS:
        parser.add_argument(f"--{name}", metavar=metavar, default=None, help=text)


FLAGS = (
    (
        "label",
        "COL",
        "Parquet without tpurec's metadata: the label column (0/1; default: one named label/click/target)",
    ),
    ("dense", "COL[,COL...]", "Parquet without tpurec's metadata: dense columns, globs allowed ('f_*')"),
    (
        "sparse",
        "NAME[:ROWS][,...]",
        "Parquet without tpurec's metadata: sparse (id) columns, globs allowed; ROWS: table size to hash into",
    ),
    ("columns", "FILE", "Parquet without tpurec's metadata: a YAML/JSON column mapping (as `data inspect` prints)"),
)


def spec_from_args(args: Any) -> ColumnSpec:
    return ColumnSpec(
        getattr(args, "label", None), getattr(args, "dense", None), getattr(args, "sparse", None), args.columns
    )


def _kind(t: pa.DataType) -> str | None:
    """The role a column of this type can play: "float", "bool", one of the sparse kinds, or None."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return INT
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return STRING
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _kind(t.value_type)
        return {INT: INT_LIST, STRING: STRING_LIST}.get(inner or "")
    return None


def _describe(kind: str | None, t: pa.DataType) -> str:
    return {INT_LIST: "lists of ints", STRING_LIST: "lists of strings", STRING: "strings"}.get(kind or "", str(t))


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _match(pattern: str, columns: list[str], what: str) -> list[str]:
    """The columns `pattern` names, in schema order: an exact name, or a glob matching at least one."""
    if pattern in columns:
        return [pattern]
    if _is_glob(pattern):
        hits = [c for c in columns if fnmatch.fnmatchcase(c, pattern)]
        if hits:
            return hits
        raise MappingError(f"{what} {pattern!r} matches no column (the data has: {_listing(columns)})")
    raise MappingError(f"{what}: unknown column {pattern!r} (the data has: {_listing(columns)})")


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _listing(columns: list[str], most: int = 12) -> str:
    shown = ", ".join(columns[:most])
    return shown + (f", ... ({len(columns)} in all)" if len(columns) > most else "")


def load_file(path: str) -> dict:
    """A mapping file: YAML (``.yaml``/``.yml``, or anything not ``.json``) or JSON."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise MappingError(f"--columns {path}: cannot read ({e.strerror or e})") from None
    try:
        if path.lower().endswith(".json"):
            doc = json.loads(text)
        else:
            import yaml

            doc = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError / ValueError: the file's own syntax
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kind = "JSON" if path.lower().endswith(".json") else "YAML"
        raise MappingError(f"--columns {path}: not valid {kind} ({first})") from None
    if not isinstance(doc, dict) or not set(doc) <= {"label", "dense", "sparse"}:
        raise MappingError(f"--columns {path}: expected a mapping with label, dense and sparse (see docs/data.md)")
    return doc


def _file_parts(doc: dict, path: str) -> tuple[str | None, list[str] | None, list[str] | None]:
    """(label, dense patterns, sparse "NAME[:ROWS]" entries) of a mapping file's document."""
    label, dense, sparse = doc.get("label"), doc.get("dense"), doc.get("sparse")
    if label is not None and not isinstance(label, str):
        raise MappingError(f"--columns {path}: label must be a column name")
    if isinstance(dense, str):
        dense = _split(dense)
    if dense is not None and not (isinstance(dense, list) and all(isinstance(x, str) for x in dense)):
        raise MappingError(f"--columns {path}: dense must be a list of column names")
    entries: list[str] | None = None
    if isinstance(sparse, dict):
        entries = [n if r is None else f"{n}:{r}" for n, r in sparse.items()]
    elif isinstance(sparse, list) and all(isinstance(x, str) for x in sparse):
        entries = list(sparse)
    elif isinstance(sparse, str):
        entries = _split(sparse)
    elif sparse is not None:
        raise MappingError(f"--columns {path}: sparse must map column names to table rows (or null)")
    return label, dense, entries


def _rows(entry: str, what: str) -> tuple[str, int | None]:
    name, sep, rows = entry.rpartition(":")
    if not sep:
        return entry, None
    try:
        n = int(rows)
    except ValueError:
        raise MappingError(f"{what} {entry!r}: ROWS {rows!r} is not a whole number") from None
    if not 1 <= n <= 2**40:
        raise MappingError(f"{what} {entry!r}: ROWS must be in [1, 2^40]")
    return name, n


def resolve(spec: ColumnSpec, schema: pa.Schema, partition_columns: tuple[str, ...] = ()) -> ColumnMapping:
    """The mapping of `spec` against the data's Arrow schema; what `spec` leaves open is inferred."""
    columns = list(schema.names)
    kinds = {n: _kind(schema.field(n).type) for n in columns}
    label, dense_p, sparse_p = None, None, None
    if spec.file:
        label, dense_p, sparse_p = _file_parts(load_file(spec.file), spec.file)
    label = spec.label if spec.label is not None else label
    dense_p = _split(spec.dense) if spec.dense is not None else dense_p
    sparse_p = _split(spec.sparse) if spec.sparse is not None else sparse_p
    inferred = []
    if label is None:
        label = _infer_label(columns, kinds)
        inferred.append("label")
    _match(label, columns, "--label")
    _check_label(label, kinds[label], schema.field(label).type)
    used = {label}
    dense = _dense(dense_p, columns, kinds, schema, used) if dense_p is not None else None
    sparse = _sparse(sparse_p, columns, kinds, schema, used) if sparse_p is not None else None
    # another label-named column is a copy or a variant of the label: never inferred as a feature
    label_like = tuple(c for c in columns if c.lower() in LABEL_NAMES and c not in used)
    free = [c for c in columns if c not in used and c not in partition_columns and c not in label_like]
    if dense is None:
        dense = [c for c in free if kinds[c] in ("float", "bool") and not _taken(c, sparse)]
        inferred.append("dense")
    if sparse is None:
        sparse = [
            SparseColumn(c, None, kinds[c] or "") for c in free if kinds[c] in (INT, STRING, INT_LIST, STRING_LIST)
        ]
        sparse = [f for f in sparse if f.name not in dense]
        inferred.append("sparse")
    chosen = {label, *dense, *(f.name for f in sparse)}
    skipped = tuple(c for c in columns if c not in chosen) if inferred else ()
    left_out = tuple(c for c in label_like if c in skipped and ("dense" in inferred or "sparse" in inferred))
    return ColumnMapping(label, dense, sparse, tuple(inferred), skipped, left_out)


def _taken(name: str, sparse: list[SparseColumn] | None) -> bool:
    return sparse is not None and any(f.name == name for f in sparse)


def _infer_label(columns: list[str], kinds: dict) -> str:
    for want in LABEL_NAMES:
        for c in columns:
            if c.lower() == want and kinds[c] in ("float", "bool", INT):
                return c
    raise MappingError(
        f"no label column (none named {'/'.join(LABEL_NAMES)}): name it with --label COL "
        f"(the data has: {_listing(columns)})"
    )


def _check_label(name: str, kind: str | None, t: pa.DataType) -> None:
    if kind not in ("float", "bool", INT):
        raise MappingError(
            f"--label {name}: the column holds {_describe(kind, t)}; a label is one number (0/1) per row"
        )


def _claim(name: str, used: set[str], what: str) -> None:
    if name in used:
        raise MappingError(f"{what}: column {name!r} is mapped twice (label, dense and sparse columns are distinct)")
    used.add(name)


def _dense(patterns: list[str], columns: list[str], kinds: dict, schema: pa.Schema, used: set[str]) -> list[str]:
    out = []
    for p in patterns:
        for name in _match(p, columns, "--dense"):
            if _is_glob(p) and name in used:
                continue  # 'f_*' leaves out the columns mapped already
            kind = kinds[name]
            if kind not in ("float", "bool", INT):
                hint = (
                    "; give it as --sparse (its values are hashed to ids)"
                    if kind in (STRING, INT_LIST, STRING_LIST)
                    else ""
                )
                raise MappingError(
                    f"--dense: column {name!r} holds {_describe(kind, schema.field(name).type)}, not numbers{hint}"
                )
            _claim(name, used, "--dense")
            out.append(name)
    return out


def _sparse(
    entries: list[str], columns: list[str], kinds: dict, schema: pa.Schema, used: set[str]
) -> list[SparseColumn]:
    out = []
    for entry in entries:
        pattern, rows = _rows(entry, "--sparse")
        for name in _match(pattern, columns, "--sparse"):
            if _is_glob(pattern) and name in used:
                continue
            kind = kinds[name]
            if kind not in (INT, STRING, INT_LIST, STRING_LIST):
                hint = "; give it as --dense" if kind in ("float", "bool") else ""
                raise MappingError(
                    f"--sparse: column {name!r} holds {_describe(kind, schema.field(name).type)}, not integer or "
                    f"string ids (or lists of them){hint}"
                )
            _claim(name, used, "--sparse")
            out.append(SparseColumn(name, rows, kind))
    return out
