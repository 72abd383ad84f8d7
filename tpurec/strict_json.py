"""Every JSON document tpurec writes (files and --json output) is strict JSON.

Python's `json.dumps` writes a float NaN or infinity as `NaN` / `Infinity`, which strict parsers
(JavaScript's JSON.parse, jq, Go, serde) refuse: a 1-row dataset's oracle AUC, an AUC over one
class, a rate over no time are such values. Here a value that can be undefined is written `null`,
and anything else non-finite left would raise (`allow_nan=False`) rather than be written. Imports
nothing from tpurec: every layer writes JSON.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf; numpy's float64 too) replaced by None,
    through dicts, lists and tuples (tuples become lists, as JSON writes them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite(value)`, strict (`allow_nan=False`); other keyword arguments as json's."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value: Any, f: IO[str], **kwargs: Any) -> None:
    f.write(dumps(value, **kwargs))
