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


def test_the_command_list_says_train_takes_your_own_model_and_data():
    """Issue 63 item 7: `tpurec --help` described train as DLRM / DLRM-DCNv2 only, data as Criteo-style
    only; `train --model-module` trains the user's own TorchRec model on any Parquet (docs/your_model.md)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in commands._choices_actions}
    assert "--model-module" in helps["train"] and "your own" in helps["train"], helps["train"]
    assert "your own Parquet" in helps["data"], helps["data"]
    train = commands.choices["train"]
    assert "--model-module" in train.description, train.description
