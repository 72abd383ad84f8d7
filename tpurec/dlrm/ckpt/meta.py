"""A checkpoint's own metadata, checked like flags before a resume trusts it.

`meta.json` (step, world size, data position, config) and `rank-R.json` (reader position, RNG
states) steer the resume: a step of -1, a world size of 0 or a missing field would resume at a wrong
step or position, or fail deep inside with a traceback. They are covered by CHECKSUMS.json, but a
checksum only says the file is what was sealed, not that what was sealed is sane (an edited file
re-sealed, a tool writing its own). Each is refused in one line naming the file and the field.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tpurec.errors import UserError
from tpurec.runtime import storage

# meta.json field -> (type, lowest, highest); every field is required (tpurec has written them all
# since checkpoints carry CHECKSUMS.json, which older ones without are refused for anyway).
META_FIELDS: dict[str, tuple[type, float | None, float | None]] = {
    "step": (int, 0, None),
    "samples": (int, 0, None),
    "world_size": (int, 1, None),
    "batch_size": (int, 1, None),
    "epoch": (int, 0, None),
    "epoch_fraction": (float, 0.0, 1.0),
    "config": (dict, None, None),
    "data": (str, None, None),
}
# rank-R.json's reader position: the fields ParquetReader.load_state_dict reads.
READER_FIELDS: dict[str, tuple[type, float | None, float | None]] = {
    "epoch": (int, 0, None),
    "rows_consumed": (int, 0, None),
    "num_rows": (int, 0, None),
    "rank": (int, 0, None),
    "world_size": (int, 1, None),
    "seed": (int, None, None),
    "shuffle": (bool, None, None),
}
RNG_LENGTHS = {"torch": None, "numpy": 5, "python": 3}  # list lengths rng_state() writes (None: any)


_KINDS = {
    int: "an integer",
    float: "a number",
    dict: "an object",
    str: "a string",
    bool: "true or false",
    list: "a list",
}


class CheckpointMetaError(UserError):
    """meta.json or rank-R.json holds a field of the wrong type or out of its range, or lacks one."""


def _field_problem(doc: dict, name: str, kind: type, low: float | None, high: float | None) -> str | None:
    if name not in doc:
        return f'no "{name}" field'
    value = doc[name]
    is_number = kind is float and type(value) in (int, float)
    if not (is_number or type(value) is kind):  # exact types: true/false are not integers here
        return f'"{name}" is {json.dumps(value)}; must be {_KINDS[kind]}'
    if is_number and not math.isfinite(value):
        return f'"{name}" is {value}; must be a finite number'
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        return f'"{name}" is {json.dumps(value)}; must be {_KINDS[kind]} {bounds}'
    return None


def _check(path: Path, doc: Any, fields: dict, within: str | None = None) -> None:
    """Each of `fields` in object `doc` (the value of key `within` of the file, or the file's)."""
    where = f'{path}: "{within}"' if within else str(path)
    if not isinstance(doc, dict):
        raise CheckpointMetaError(f"{where}: {json.dumps(doc)[:40]} is not an object")
    for name, (kind, low, high) in fields.items():
        problem = _field_problem(doc, name, kind, low, high)
        if problem:
            raise CheckpointMetaError(f"{where}: {problem}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointMetaError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointMetaError(f"{path}: unreadable ({e})") from None


def read_meta(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's meta.json, every field present, of its type and in its range."""
    path = storage.path(checkpoint) / "meta.json"
    meta = _read_json(path)
    _check(path, meta, META_FIELDS)
    return meta


def check_train_state(path: Path, state: Any, step: int) -> dict:  # state: JSON, checked here
    """A rank's train state (rank-R.json) as the resume uses it: reader position within its epoch,
    RNG states of the shape rng_state() writes, and the step meta.json names."""
    _check(path, state, {"step": (int, 0, None)})
    if state["step"] != step:
        raise CheckpointMetaError(f'{path}: "step" is {state["step"]}, but meta.json says {step}')
    reader, rng = state.get("reader"), state.get("rng")
    _check(path, reader, READER_FIELDS, "reader")
    if reader["rows_consumed"] > reader["num_rows"]:
        raise CheckpointMetaError(
            f'{path}: "reader": "rows_consumed" is {reader["rows_consumed"]}, past the epoch\'s '
            f'{reader["num_rows"]} rows ("num_rows")'
        )
    _check(path, rng, {name: (list, None, None) for name in RNG_LENGTHS}, "rng")
    for name, length in RNG_LENGTHS.items():
        if length is not None and len(rng[name]) != length:
            raise CheckpointMetaError(f'{path}: "rng": "{name}" has {len(rng[name])} entries, not {length}')
    return state
