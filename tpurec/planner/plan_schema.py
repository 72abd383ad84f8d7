"""The structure of a plan file, checked before anything is built from it.

A plan file is hand-editable JSON (plan_io.py has the schema), and a hand edit can put any JSON
value anywhere: a placement that is not `rank:N/DEVICE`, `"ranks": "0"`, a shard that is a list,
a meta table that is a number. Built from directly, those surfaced as TypeError or AttributeError
deep in TorchRec or in `plan_check.py`. Here every field the loaders read is checked for its kind
and range first, and the first problem is one FieldError (a UserError) naming the field by its JSON path
(`$.plan.modules[""].t_C1.shards[0].placement`). Whether the values fit the model and the world
size is `plan_check.py`'s job; nesting too deep for Python's JSON parser is refused by the reader.

The walk follows the schema, never the document, so its depth is fixed however deep the file nests.
"""

from __future__ import annotations

import re
from typing import Any

from tpurec.json_fields import (
    Check,
    bad,
    choice,
    each,
    fields,
    finite_numbers,
    flag,
    items,
    key_path,
    map_of,
    number,
    obj,
    optional,
    text,
    whole,
)

# `rank:N/DEVICE[:INDEX]`, as TorchRec writes placements; the device types a plan can name.
PLACEMENT = re.compile(r"^rank:(\d+)/(cpu|cuda|tpu|meta)(:\d+)?$")
PARAMETER_FIELDS = (
    "sharding_type",
    "compute_kernel",
    "ranks",
    "shards",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "cache_params",
)
SHARD_FIELDS = ("offsets", "sizes", "placement")


def _placement(at: str, v: Any) -> None:
    if not isinstance(v, str) or not PLACEMENT.match(v):
        raise bad(at, v, "a placement 'rank:N/DEVICE' (DEVICE: cpu, tpu:I, cuda:I or meta)")


def _pair(at: str, v: Any) -> None:
    """A shard's offsets or sizes: [rows, columns] of a 2-D table."""
    if len(items(at, v)) != 2:
        raise bad(at, v, "[rows, columns] (2 whole numbers)")
    for i, x in enumerate(v):
        whole(f"{at}[{i}]", x)


def _shard(at: str, v: Any) -> None:
    checks = {"offsets": _pair, "sizes": _pair, "placement": _placement}
    fields(at, obj(at, v, SHARD_FIELDS), checks, required=SHARD_FIELDS)


def _enum_names() -> tuple[list[str], list[str]]:
    """The names plan_io turns into FBGEMM's BoundsCheckMode and TorchRec's DataType."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.types import DataType

    return [m.name for m in BoundsCheckMode], [m.name for m in DataType]


def _cache_params(at: str, v: Any) -> None:
    """A host-tier table's cache: its load factor in (0, 1] and LRU or LFU (each may be null: the default)."""

    def load_factor(a: str, x: Any) -> None:
        number(a, x)
        if not 0 < x <= 1:
            raise bad(a, x, "a load factor in (0, 1]")

    checks = {"load_factor": optional(load_factor), "algorithm": optional(choice(["LRU", "LFU"]))}
    fields(at, obj(at, v, tuple(checks)), checks, required=())


def check_parameter(at: str, p: Any) -> None:
    """One table's entry of a module plan."""
    bounds, dtypes = _enum_names()
    checks = {
        "sharding_type": text,
        "compute_kernel": text,
        "ranks": optional(each(whole)),
        "shards": optional(each(_shard)),
        "enforce_hbm": optional(flag),
        "stochastic_rounding": optional(flag),
        "bounds_check_mode": optional(choice(bounds)),
        "output_dtype": optional(choice(dtypes)),
        "cache_params": optional(_cache_params),
    }
    fields(at, obj(at, p, PARAMETER_FIELDS), checks, required=("sharding_type", "compute_kernel", "ranks", "shards"))


def check_modules(at: str, modules: Any) -> None:
    """`modules`: {module path: {table: parameter sharding}}."""
    for path, params in obj(at, modules).items():
        where = key_path(at, path)
        for name, p in obj(where, params).items():
            check_parameter(key_path(where, name), p)


def _table_spec(at: str, t: Any) -> None:
    """A meta table: tpurec.data.catalog.TableSpec's fields, as `build_report` writes them."""
    checks = {
        "name": text,
        "feature": text,
        "num_embeddings": lambda a, v: whole(a, v, 1),
        "embedding_dim": lambda a, v: whole(a, v, 1),
        "pooling_factor": number,
        "data_type": text,
        "extra_features": each(text),
        "pooling": text,
        "weighted": flag,
    }
    required = ("name", "feature", "num_embeddings", "embedding_dim", "pooling_factor")
    fields(at, obj(at, t, tuple(checks)), checks, required)


def _id_limits(at: str, v: Any) -> None:
    checks = {
        "tables": map_of(each(lambda a, x: whole(a, x, 1))),
        "layout": obj,
        "source": text,
        "hot_rows": optional(map_of(obj)),  # each table's curve (hot_rows.py), read by HotRows.from_json
    }
    fields(at, obj(at, v), checks, required=("tables", "layout"))


# The meta fields `plan show` reads (inspect.report_from_plan_and_meta); others are free-form.
META_CHECKS: dict[str, Check] = {
    "tables": each(_table_spec),
    "topology": text,
    "batch_size": lambda a, v: whole(a, v, 1),
    "optimizer": text,
    "compute_device": choice(["cpu", "tpu"]),
    "reserved_bytes": optional(number),
    "headroom_fraction": optional(number),
    "sc_gather_fraction": optional(number),
    "dcn_bw_per_host": optional(number),
    "model": optional(text),
    "id_limits": optional(_id_limits),
    "refusal": optional(text),
    "smallest_fitting_topology": optional(map_of(optional(text))),
    # {table: [slots, bytes per slot, fixed bytes]} of managed-collision remaps (planner/remap_memory.py)
    "remap_buffers": optional(map_of(each(lambda a, x: whole(a, x, 0)))),
}


def _report_shard(at: str, v: Any) -> None:
    checks = {"rank": whole, "offsets": _pair, "sizes": _pair, "bytes": whole, "time_ms": number}
    fields(at, obj(at, v), checks, required=())


def _report_table(at: str, v: Any) -> None:
    checks = {
        "rows": whole,
        "dim": lambda a, x: whole(a, x, 1),
        "pooling_factor": number,
        "ranks": optional(each(whole)),
        "bytes": whole,
        "time_ms": number,
        "shards": each(_report_shard),
    }
    fields(at, obj(at, v), checks, required=())


# A `tpurec plan --format json` report's own figures (besides the plan and meta it holds): `plan show`
# recomputes them, but a hand-edited report with a NaN shard size or a fractional world size was
# read without a word (also by `data stats --plan`).
REPORT_CHECKS: dict[str, Check] = {
    "world_size": lambda a, v: whole(a, v, 1),
    "num_slices": lambda a, v: whole(a, v, 1),
    "batch_size_per_device": lambda a, v: whole(a, v, 1),
    "tables": each(_report_table),
}


def check_numbers(doc: dict, report: bool) -> None:
    """Every number of a plan file or report finite (NaN, Infinity anywhere refused by its JSON path),
    and a report's own sizes and counts whole numbers."""
    if report:
        fields("$", doc, REPORT_CHECKS, required=())
    finite_numbers("$", doc)


def check_meta(at: str, meta: Any) -> None:
    """A plan's meta (absent or null: none)."""
    if meta is not None:
        fields(at, obj(at, meta), META_CHECKS, required=())
