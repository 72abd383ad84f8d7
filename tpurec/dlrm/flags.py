"""Command-line flags declared on dataclass fields, so a setting, its default and its help live in one place.

A field made with `flag(...)` carries its help text (and any other argparse keyword: choices,
metavar, nargs, ...) in its metadata; `add_flags` turns the flagged fields of a dataclass into
argparse options (`batch_size` -> `--batch-size`, the type taken from the field's annotation, a
`bool` field -> `store_true`), and `values` reads the parsed namespace back into field values.
`tpurec train`'s flags are built this way from `tpurec.dlrm.options.TrainOptions`, whose config
overrides take their help from `tpurec.dlrm.configs.DLRMConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from types import UnionType
from typing import Any, TypeVar

_T = TypeVar("_T")
FLAG_KEY = _KEY = "flag"  # metadata key: the argparse keywords of a flagged field


def flag(default: _T, help: str, **argparse_kwargs: Any) -> _T:
    """A dataclass field with a default that is also a command-line flag.

    Typed as its default, like dataclasses.field: the class body declares the field's type."""
    return dataclasses.field(default=default, metadata=flag_metadata(help, **argparse_kwargs))


def flag_metadata(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """The field metadata that makes a dataclass field a flag."""
    return {_KEY: {"help": help, **argparse_kwargs}}


def flag_kwargs(cls: type, name: str) -> dict:
    """The argparse keywords declared on field `name` of dataclass `cls` (KeyError if not a flag)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dict(field.metadata[_KEY])


def flagged_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if _KEY in f.metadata]


def option_string(name: str) -> str:
    return "--" + name.replace("_", "-")


def spelling(field: dataclasses.Field) -> str:
    """The command-line spelling of a flagged field (its `option`, else from its name)."""
    return field.metadata[_KEY].get("option") or option_string(field.name)


def as_argv(obj: object, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that give `obj`'s flagged fields their values, those at their default left out:
    a run's command line again (a tuple as its comma-joined form, True as the bare flag)."""
    words: list[str] = []
    for f in flagged_fields(type(obj)):
        value = getattr(obj, f.name)
        if f.name in skip or value is None or value == f.default or value is False:
            continue
        words.append(spelling(f))
        if value is not True:
            words.append(",".join(map(str, value)) if isinstance(value, tuple) else str(value))
    return words


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, only: tuple[str, ...] | None = None
) -> None:
    """One argparse option per flagged field of `cls` (or of those named in `only`), in field order:
    `only` lends another command some of a dataclass's flags, with the same spelling, default and help."""
    hints = typing.get_type_hints(cls)
    for f in flagged_fields(cls):
        if only is not None and f.name not in only:
            continue
        kwargs = dict(f.metadata[_KEY])
        aliases = kwargs.pop("aliases", ())  # other spellings, e.g. TorchRec's example's flag names
        kwargs.pop("option", None)  # a flag named unlike its field: `spelling`
        kind = _plain_type(hints[f.name])
        if kind is bool:
            kwargs.setdefault("action", "store_true")
        elif kind is not str and "type" not in kwargs:
            kwargs["type"] = kind  # str is argparse's own default: leave it implicit
        parser.add_argument(spelling(f), *aliases, dest=f.name, default=f.default, **kwargs)


def values(cls: type, namespace: argparse.Namespace) -> dict:
    """{field name: parsed value} for every flagged field of `cls` found in an argparse namespace."""
    return {f.name: getattr(namespace, f.name) for f in flagged_fields(cls) if hasattr(namespace, f.name)}


def _plain_type(hint: Any) -> Any:
    """`int | None` -> int; a plain type unchanged."""
    if typing.get_origin(hint) is tuple:
        return tuple
    if typing.get_origin(hint) is typing.Literal:  # a closed set of strings: str, with its choices
        return str
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"a flag needs one type, not {hint}")
    return hint
