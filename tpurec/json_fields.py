"""Checking the fields of a JSON document a user may have edited, by the document's schema.

A hand edit can put any JSON value anywhere; read as is, a wrong kind surfaces as a TypeError or
AttributeError far from the file. The checks here walk a document along its schema (never along the
document, so their depth is fixed however deep the file nests) and raise one `FieldError` naming
the first wrong field by its JSON path, e.g. `$.plan.modules[""].t_C1.ranks: '0' is not a list`.
A check is `check(at, value)`, `at` the value's path; `fields` applies a dict of them to an object.
Used for plan files (tpurec/planner/plan_schema.py) and dataset metadata (tpurec/data/schema.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Callable

from tpurec.errors import UserError

Check = Callable[[str, Any], object]  # raises FieldError on a bad value; what it returns is unused

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class FieldError(UserError):
    """A field of a JSON document of the wrong kind; the message starts with its JSON path."""


def key_path(at: str, key: str) -> str:
    """`at.key`, or `at["key"]` when the key is not an identifier (module path "" included)."""
    return f"{at}.{key}" if _IDENT.match(key) else f"{at}[{_quote(key)}]"


def _quote(key: str) -> str:
    return json.dumps(key)


def bad(at: str, value: Any, want: str) -> FieldError:
    # a short flat list as written; other lists and objects by kind (they may be huge or deep)
    flat = isinstance(value, list) and len(value) <= 8 and not any(isinstance(x, (list, dict)) for x in value)
    shown = type(value).__name__ if isinstance(value, (dict, list)) and not flat else repr(value)
    return FieldError(f"{at}: {shown} is not {want}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a rank or a size


def whole(at: str, v: Any, lo: int = 0) -> None:
    if not _is_int(v) or v < lo:
        raise bad(at, v, f"a whole number >= {lo}")


def text(at: str, v: Any) -> None:
    if not isinstance(v, str):
        raise bad(at, v, "a string")


def number(at: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(at, v, "a finite number")


def flag(at: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise bad(at, v, "true or false")


def obj(at: str, v: Any, known: tuple[str, ...] | None = None) -> dict:
    """`v` as a JSON object; with `known`, a key outside it (a typo) is refused too."""
    if not isinstance(v, dict):
        raise bad(at, v, "an object")
    if known is not None:
        extra = sorted(set(v) - set(known))
        if extra:
            raise FieldError(f"{key_path(at, extra[0])}: unknown field; known: {', '.join(known)}")
    return v


def items(at: str, v: Any) -> list:
    if not isinstance(v, list):
        raise bad(at, v, "a list")
    return v


def optional(check: Check) -> Check:
    def run(at: str, v: Any) -> None:
        if v is not None:
            check(at, v)

    return run


def choice(names: list[str]) -> Check:
    def run(at: str, v: Any) -> None:
        if v not in names:
            raise bad(at, v, f"one of {', '.join(names)}")

    return run


def fields(at: str, doc: dict, checks: Mapping[str, Check], required: tuple[str, ...]) -> None:
    """Check each present field of `doc` with its check; a required one missing is refused."""
    for name, check in checks.items():
        if name not in doc:
            if name in required:
                raise FieldError(f"{key_path(at, name)}: missing")
            continue
        check(key_path(at, name), doc[name])


def each(check: Check) -> Check:
    def run(at: str, v: Any) -> None:
        for i, x in enumerate(items(at, v)):
            check(f"{at}[{i}]", x)

    return run


def finite_numbers(at: str, doc: Any) -> None:
    """Every number anywhere in `doc` finite: Python's JSON parser reads `NaN`, `Infinity` and `1e400`
    as floats no check of a field's kind would question in a free-form part. Walked with a stack, not
    recursion (the parser already bounds the depth); the first one found is refused by its path."""
    stack: list[tuple[str, Any]] = [(at, doc)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise bad(where, v, "a finite number")
        if isinstance(v, dict):
            stack.extend((key_path(where, str(k)), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))


def map_of(check: Check) -> Check:
    def run(at: str, v: Any) -> None:
        for k, x in obj(at, v).items():
            check(key_path(at, k), x)

    return run
