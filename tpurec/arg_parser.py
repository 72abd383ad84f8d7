"""The `tpurec` command's argparse parser: every command-line error in one line, a mistyped flag or
choice answered with the closest real one ("did you mean --batch-size?").

Python 3.11's argparse has no suggest_on_error (3.14 adds one) and prints the whole usage before a
bad choice (25 lines for `tpurec train --model x`). Subcommand parsers are made by add_subparsers,
which builds them with the parent's class, so the root's class covers every subcommand.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Iterable, NoReturn, Sequence


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest `word` by difflib's ratio (at least 0.6, leading dashes aside), or None."""
    by_name = {c.lstrip("-"): c for c in candidates}
    found = difflib.get_close_matches(word.lstrip("-"), list(by_name), n=1, cutoff=0.6)
    return by_name[found[0]] if found else None


def closest_flag(word: str, options: Iterable[str]) -> str | None:
    """The long option nearest a flag-looking `word` that is none of `options` (nor a prefix of just
    one, which argparse accepts), or None."""
    flag = word.split("=", 1)[0]
    longs = [o for o in options if o.startswith("--")]
    if not flag.startswith("--") or flag in longs or len([o for o in longs if o.startswith(flag)]) == 1:
        return None
    return closest(flag, longs)


def suggestion(message: str, options: Iterable[str]) -> str:
    """' (did you mean X?)' for the first mistyped flag or choice argparse's `message` names, or ''."""
    options = list(options)
    unrecognized = re.match(r"unrecognized arguments: (.*)", message)
    if unrecognized:
        for word in unrecognized.group(1).split():
            match = closest_flag(word, options)
            if match:
                return f" (did you mean {match}?)"
        return ""
    choice = re.match(r"argument .*: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice:
        match = closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        return f" (did you mean {match}?)" if match else ""
    return ""


class SuggestingParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line: `PROG: error: MESSAGE (did you mean X?)`."""

    # The parsers of the parse under way, root first: an unknown flag is reported by the root, which
    # knows none of the subcommand's flags.
    _parsing: list[argparse.ArgumentParser] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if not any(p is self for p in SuggestingParser._parsing):
            SuggestingParser._parsing.append(self)
        return super().parse_known_args(args, namespace)

    _words: list[str] = []  # the command line being parsed

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        SuggestingParser._parsing = []
        SuggestingParser._words = [str(a) for a in (sys.argv[1:] if args is None else args)]
        try:
            return super().parse_args(args, namespace)
        finally:
            SuggestingParser._parsing, SuggestingParser._words = [], []

    def error(self, message: str) -> NoReturn:
        parsers = SuggestingParser._parsing or [self]
        innermost = parsers[-1] if message.startswith("unrecognized arguments") else self
        options = [o for p in parsers for o in p._option_string_actions]
        hint = suggestion(message, options)
        if not hint:
            # A mistyped flag can surface as another error (its value taken for a sub-command or a
            # required flag then missing): name the flag when it is close to a real one.
            for word in SuggestingParser._words:
                match = closest_flag(word, options)
                if match:
                    message, hint = f"unrecognized argument {word.split('=', 1)[0]}", f" (did you mean {match}?)"
                    break
        sys.stderr.write(f"{innermost.prog}: error: {message}{hint}; see {innermost.prog} --help\n")
        sys.exit(2)
