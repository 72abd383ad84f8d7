"""The `tpurec plan --tables FILE` schema: read strictly, every problem one line naming the file,
the table and the key. Plain data (no torch), so a bad file is refused at once.

A file is a JSON or YAML list of tables, or `{"tables": [...]}`. Each table is an object whose keys
are those of FIELDS below (docs/planner.md, "Tables file", documents them). To add a key, add one
entry to FIELDS: its parser gets the raw value and the entry, and returns the value or raises
`_Bad("...")`; `Entry` and `TableSpec` carry the result.

Sequence tables: `pooling: none` makes a table unpooled (TorchRec's EmbeddingCollection, one output
row per id); its `pooling_factor` is then the mean sequence length (ids per sample), which sizes its
outputs and buffers. `inspect.tables_module` builds one EmbeddingCollection per dim for them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from tpurec.data.catalog import TableSpec
from tpurec.errors import UserError
from tpurec.planner.plan_bounds import tables_problem

MAX_TABLE_ROWS = 2**40  # far above any real table; catches 1e20 and unit mistakes
MAX_EMBEDDING_DIM = 65536
DATA_TYPES = ("fp32", "fp16", "bf16")
POOLINGS = ("sum", "mean", "none")  # none: a sequence table (EmbeddingCollection)
# tpurec.planner.kernel_choice.SHARDING_TYPES, spelled out so that reading a file imports no
# torchrec (tests/planner/test_tables_file.py checks the two agree).
SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")


class _Bad(UserError):
    """A bad value; the reader prefixes the file, table and key."""


@dataclass(frozen=True)
class Entry:
    """One table of a tables file: its spec plus the planner constraints it asks for."""

    spec: TableSpec
    feature_pooling: tuple[float, ...]  # mean ids per sample of each feature (ParameterConstraints.pooling_factors)
    sharding_types: tuple[str, ...] | None = None  # ParameterConstraints.sharding_types
    min_partition: int | None = None  # ParameterConstraints.min_partition (narrowest column shard)


def _whole(hi: int) -> Callable[[Any, dict], int]:
    def parse(value: Any, t: dict) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise _Bad(f"{value!r} is not a whole number")
        try:
            number = value if isinstance(value, int) else float(value)
        except ValueError:
            raise _Bad(f"{value!r} is not a whole number") from None
        # an int is whole already; isfinite() of one past a float's range (10**400) raised OverflowError
        if not isinstance(number, int) and (not math.isfinite(number) or number != int(number)):
            raise _Bad(f"{value!r} is not a whole number")
        if not 1 <= number <= hi:
            raise _Bad(f"{value!r} must be in [1, {hi:,}]")
        return int(number)

    return parse


def _name(value: Any, t: dict) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad(f"{value!r} must be a non-empty string")
    return value


def _features(value: Any, t: dict) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(f, str) and f for f in items):
        raise _Bad(f"{value!r} must be a feature name or a non-empty list of them")
    if len(set(items)) != len(items):
        raise _Bad(f"{value!r} names a feature twice")
    return tuple(items)


# The most ids per sample a feature can have: a batch's ids are int32 on the SparseCore. 1e308 passed
# as finite and overflowed to infinity in the buffer sizes (an OverflowError traceback).
MAX_POOLING_FACTOR = 2**31 - 1


def _positive(value: Any) -> float:
    if isinstance(value, bool):
        raise _Bad(f"{value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float's range
        raise _Bad(f"{value!r} is not a number") from None
    if not math.isfinite(number) or not 0 < number <= MAX_POOLING_FACTOR:
        raise _Bad(f"{number!r} must be a finite number in (0, {MAX_POOLING_FACTOR:,}]")
    return number


def _pooling_factor(value: Any, t: dict) -> tuple[float, ...]:
    """One number (each feature's mean ids per sample) or a list, one per feature."""
    if isinstance(value, list):
        return tuple(_positive(v) for v in value)
    return (_positive(value),)


def _choice(options: tuple[str, ...]) -> Callable[[Any, dict], str]:
    def parse(value: Any, t: dict) -> str:
        v = str(value).lower()
        if v not in options:
            raise _Bad(f"{value!r} must be one of {', '.join(options)}")
        return v

    return parse


def _pooling(value: Any, t: dict) -> str:
    if value is None:  # YAML's bare `none`/`null`
        value = "none"
    return _choice(POOLINGS)(value, t)


def _bool(value: Any, t: dict) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"{value!r} must be true or false")
    return value


def _sharding_types(value: Any, t: dict) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise _Bad(f"{value!r} must be a non-empty list of {', '.join(SHARDING_TYPES)}")
    bad = [s for s in items if s not in SHARDING_TYPES]
    if bad:
        raise _Bad(f"{bad} not among the SparseCore kernel's {', '.join(SHARDING_TYPES)}")
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class Field:
    parse: Callable[[Any, dict], Any]
    required: bool = False
    alias: str | None = None  # an older or shorter spelling, accepted too (not both)


FIELDS: dict[str, Field] = {
    "name": Field(_name, required=True),
    "num_embeddings": Field(_whole(MAX_TABLE_ROWS), required=True, alias="rows"),
    "embedding_dim": Field(_whole(MAX_EMBEDDING_DIM), required=True, alias="dim"),
    "features": Field(_features, alias="feature"),  # default: [name]
    "pooling": Field(_pooling),  # default sum
    "pooling_factor": Field(_pooling_factor),  # default 1 per feature
    "weighted": Field(_bool),  # default false
    "data_type": Field(_choice(DATA_TYPES)),  # default fp32
    "sharding_types": Field(_sharding_types),  # default: all of SHARDING_TYPES
    "min_partition": Field(_whole(MAX_EMBEDDING_DIM)),  # default: TorchRec's
}
KNOWN = sorted([*FIELDS, *(f.alias for f in FIELDS.values() if f.alias)])


def _read(path: str) -> Any:  # the parsed YAML/JSON document
    try:
        with open(path) as f:
            if path.endswith((".yaml", ".yml")):
                import yaml

                return yaml.safe_load(f)
            return json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:  # JSON or YAML syntax: say where
        raise UserError(f"{path}: not a valid tables file ({type(e).__name__}: {e})") from None


def load_tables(path: str, devices: int | None = None) -> list[Entry]:
    """The tables of the file; more than tpurec plans (on `devices` devices, when given) is refused
    before they are read one by one."""
    doc = _read(path)
    if isinstance(doc, dict):
        extra = sorted(set(doc) - {"tables"})
        if extra:
            raise UserError(f"{path}: unknown top-level key(s) {extra}; a tables file is a list or {{'tables': [...]}}")
        doc = doc.get("tables")
    if not isinstance(doc, list) or not doc:
        raise UserError(f"{path}: expected a list of tables (or {{'tables': [...]}})")
    too_many = tables_problem(len(doc), devices)
    if too_many:
        raise UserError(f"{path}: {too_many}")
    out: list[Entry] = []
    names: set[str] = set()
    features: dict[str, str] = {}
    for i, raw in enumerate(doc):
        entry = _entry(path, i, raw)
        where = f"{path}: table #{i} ({entry.spec.name!r})"
        if entry.spec.name in names:
            raise UserError(f"{path}: table #{i}: name {entry.spec.name!r} is used twice")
        names.add(entry.spec.name)
        for f in entry.spec.feature_names:
            if f in features:
                raise UserError(f"{where}: feature {f!r} is already served by table {features[f]!r}")
            features[f] = entry.spec.name
        out.append(entry)
    _check_module_names(path, out)
    return out


def _check_module_names(path: str, entries: list[Entry]) -> None:
    """TorchRec keeps tables in an nn.ModuleDict keyed by name, which refuses dots and the names of
    its own attributes ('half', 'float', 'train'...) with a bare KeyError deep in the model build.
    Checked last: it needs torch, which planning imports anyway, so other errors stay instant."""
    import torch

    for i, e in enumerate(entries):
        if "." in e.spec.name or hasattr(torch.nn.ModuleDict, e.spec.name):
            raise UserError(
                f"{path}: table #{i} ({e.spec.name!r}): name cannot name a TorchRec table "
                "(no dots, not a torch.nn.Module attribute such as 'half' or 'train'); rename it"
            )


def _entry(path: str, i: int, t: Any) -> Entry:
    if not isinstance(t, dict):
        raise UserError(f"{path}: table #{i} is {type(t).__name__}, expected an object with name, rows, dim")
    name = t.get("name")
    where = f"{path}: table #{i}" + (f" ({name!r})" if isinstance(name, str) and name else "")
    unknown = sorted(set(map(str, t)) - set(KNOWN))
    if unknown:
        raise UserError(f"{where}: unknown field(s) {unknown}; known: {KNOWN}")
    values = {}
    for key, field in FIELDS.items():
        given = [k for k in (key, field.alias) if k and k in t]
        if len(given) > 1:
            raise UserError(f"{where}: give '{key}' or '{field.alias}', not both")
        if not given:
            if field.required:
                alias = f" (or '{field.alias}')" if field.alias else ""
                raise UserError(f"{where}: needs '{key}'{alias}" + (" (a non-empty string)" if key == "name" else ""))
            continue
        try:
            values[key] = field.parse(t[given[0]], t)
        except _Bad as e:
            raise UserError(f"{where}: {given[0]} {e}") from None
    features = values.get("features", (values["name"],))
    pooling = values.get("pooling_factor", (1.0,))
    if len(pooling) == 1:
        pooling = pooling * len(features)
    elif len(pooling) != len(features):
        raise UserError(
            f"{where}: pooling_factor has {len(pooling)} values for {len(features)} feature(s) {list(features)}"
        )
    spec = TableSpec(
        values["name"],
        features[0],
        values["num_embeddings"],
        values["embedding_dim"],
        sum(pooling),
        values.get("data_type", "fp32"),
        extra_features=features[1:],
        pooling=values.get("pooling", "sum"),
        weighted=values.get("weighted", False),
    )
    return Entry(spec, tuple(pooling), values.get("sharding_types"), values.get("min_partition"))
