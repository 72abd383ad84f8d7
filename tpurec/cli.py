"""The `tpurec` command.

Each subcommand lives in its own module, which exposes `register(subparsers)` (builds its argparse
parser without importing anything heavy, so `tpurec --help` is instant) and `run(args) -> int`.
A subcommand appears in the help only once its module is listed below.

Its argparse parser (`SuggestingParser`) prints every command-line error in one line, a mistyped flag
or choice answered with the closest real one ("did you mean --batch-size?"). Python 3.11's argparse
has no suggest_on_error (3.14 adds one) and prints the whole usage before a bad choice (25 lines for
`tpurec train --model x`). Subcommand parsers are made by add_subparsers, which builds them with the
parent's class, so the root's class covers every subcommand.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from typing import Iterable, NoReturn, Sequence

from tpurec import __version__

# name -> module implementing it. Add a line here when a subcommand lands.
SUBCOMMANDS: dict[str, str] = {
    "env": "tpurec.env_report",
    "data": "tpurec.data.cli",
    "bench": "tpurec.bench.cli",
    "plan": "tpurec.planner.cli",
    "selftest": "tpurec.selftest.cli",
    "train": "tpurec.dlrm.cli",
    "launch": "tpurec.launch.cli",
}


# Actions of a subcommand implemented in a higher layer than the subcommand's own module:
# module holding the subcommand's `actions` subparsers -> module implementing the action.
SUB_ACTIONS: dict[str, tuple[str, ...]] = {
    "tpurec.data.cli": (
        "tpurec.planner.limits_cli",  # `tpurec data stats`: limits for a plan's layout
        "tpurec.dlrm.zch_stats",  # its --zch: the ids after `tpurec train --zch`'s remap
        "tpurec.planner.model_synth",  # `tpurec data synth --model-module`: data for a user's model
    ),
}


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


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(  # one-line errors, "did you mean" (every subcommand)
        prog="tpurec",
        description="TorchRec on TPU: SparseCore embedding kernels, sharding planner, DLRM pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"tpurec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    for owner, modules in SUB_ACTIONS.items():
        for module in modules:  # in order: a later one may add to an earlier one's action
            importlib.import_module(module).register(importlib.import_module(owner).actions)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (tpurec.errors.UserError, or an OSError: a path missing or
    unwritable, a full disk) prints as one line and exits 2; any other exception is a bug and
    propagates with its traceback."""
    from tpurec.errors import EXIT_USER_ERROR, UserError
    from tpurec.runtime import interrupts
    from tpurec.runtime.gc_tuning import collect_less

    collect_less()  # before a command imports torch

    args = None
    with interrupts.handled():
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "run", None):
                parser.print_help()
                return 0 if args.command is None else 2
            return int(args.run(args) or 0)
        except (UserError, OSError) as e:
            print(f"{error_prefix(args)}: {e}", file=sys.stderr)
            code = EXIT_USER_ERROR
        except KeyboardInterrupt as e:  # Ctrl-C: one line, not a traceback (tpurec/runtime/interrupts.py)
            words = sys.argv[1:] if argv is None else argv
            command = next((f"tpurec {w}" for w in words if not str(w).startswith("-")), "tpurec")
            print(interrupts.line(command, e), file=sys.stderr)
            code = interrupts.EXIT_INTERRUPTED
    if argv is None:  # this process's own command line: the interpreter exits next
        import gc

        # The failed work's frames (pyarrow's CSV reader among them) freed now, not at interpreter exit,
        # where pyarrow can abort the process (exit 134). A caller passing argv goes on living (tests
        # call main in-process, where a full collection of their heap costs ~0.5 s a call).
        gc.collect()
    return code


def error_prefix(args: argparse.Namespace | None) -> str:
    """`tpurec COMMAND: error` (argparse's form), or the command's own (`set_defaults(error_prefix=...)`)."""
    if args is None or not getattr(args, "command", None):
        return "tpurec: error"
    return getattr(args, "error_prefix", None) or f"tpurec {args.command}: error"


if __name__ == "__main__":
    sys.exit(main())
