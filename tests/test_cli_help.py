"""Every option of every `tpurec` command says what it does, and what it is when left out."""

import argparse

from tpurec.cli import build_parser

_FLAGS_ONLY = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


def _options(parser, path):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _options(sub, path + [name])
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(path), a


def test_every_option_has_help_and_names_its_default():
    options = list(_options(build_parser(), ["tpurec"]))
    assert len(options) > 100  # every command's options were walked
    no_help = [f"{cmd} {a.option_strings or a.dest}" for cmd, a in options if not a.help]
    assert no_help == []
    silent_default = [
        f"{cmd} {a.option_strings}: default {a.default!r}"
        for cmd, a in options
        if not isinstance(a, _FLAGS_ONLY)
        and a.default not in (None, False, argparse.SUPPRESS)
        and "default" not in a.help
    ]
    assert silent_default == []
