"""Command-line mistakes: one line, with the nearest real flag or choice (tpurec/cli.py)."""

from __future__ import annotations

import argparse

import pytest

from tpurec import cli


def _leaf_parsers(parser: argparse.ArgumentParser, words=()):
    """(command words, parser) for every subcommand that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if words:
        yield words, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, (*words, name))


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_every_subcommand_suggests_the_flag_meant(capsys):
    cases = 0
    for words, parser in _leaf_parsers(cli.build_parser()):
        flags = [o for o in parser._option_string_actions if o.startswith("--") and o != "--help"]
        for flag in flags[:3]:
            typo = flag + flag[-1]  # --batch-size -> --batch-sizee
            err = _error(capsys, [*words, typo])
            assert f"(did you mean {flag}?)" in err, (words, typo, err)
            assert err.startswith(f"tpurec {' '.join(words)}: error: ")
            cases += 1
    assert cases > 40  # every subcommand of env, data, bench, plan, selftest, train, launch


def test_a_transposed_flag_is_named(capsys):
    err = _error(capsys, ["train", "--batch-szie", "5"])
    assert "unrecognized arguments: --batch-szie 5 (did you mean --batch-size?)" in err


def test_a_mistyped_flag_before_a_value_taken_for_a_subcommand(capsys):
    # `plan --topolgy v5p-8`: argparse takes v5p-8 for `plan show/diff`; the flag is what is wrong.
    err = _error(capsys, ["plan", "--model", "dlrm-tiny", "--topolgy", "v5p-8"])
    assert (
        err == "tpurec plan: error: unrecognized argument --topolgy (did you mean --topology?); see tpurec plan --help"
    )


def test_a_wrong_choice_is_one_line_naming_the_choices(capsys):
    err = _error(capsys, ["train", "--model", "dlrm-tyni"])
    assert "invalid choice: 'dlrm-tyni' (choose from 'dlrm-tiny', 'criteo-kaggle', 'mlperf-dcnv2')" in err
    assert "(did you mean dlrm-tiny?)" in err and "usage:" not in err
    assert "(did you mean train?)" in _error(capsys, ["trian"])


def test_nothing_close_gets_no_guess(capsys):
    err = _error(capsys, ["train", "--zzzz"])
    assert "did you mean" not in err and "unrecognized arguments: --zzzz" in err
