"""Bad input at the entry points of issue #41's round 4: one line naming the file, flag or target, exit
2, nothing written. In-process `tpurec.cli.main` calls, no rank started.

Before: a `--model-module` function or module that raised printed its traceback through tpurec (exit 1);
a limits file that was not JSON or not a limits file was read by the one-process trainer only after the
synthetic dataset had been made; `tpurec launch --emulate-tpu` with a slice that is not one, or a
generation without SparseCores, had no test.

Covered elsewhere: limit values (0, negative, NaN, 2^31, strings) and nesting:
test_limits_and_plan_values.py; limits of another model's tables and plans of another world or
generation: test_launch_preflight.py; limits measured for another layout (the ranks' check, printed
once): tests/test_errors.py (slow); numeric and weight-decay flags: tests/test_bad_cli_inputs.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.reliability.inproc import assert_refused
from tests.reliability.inproc import run_cli as _run

MODEL = """
    def raises():
        raise ValueError("no tables configured")

    def needs_args(x):
        return x

    def never_called():
        pass
"""


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    (tmp_path / "bad_model.py").write_text(textwrap.dedent(MODEL))
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('missing config file')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "target,says",
    [
        ("./bad_model.py:raises", "raises() raised ValueError: no tables configured at {d}/./bad_model.py:3"),
        ("./bad_model.py:needs_args", "needs_args() raised TypeError: needs_args() missing 1 required positional"),
        (
            "./raises_on_import.py:build",
            "importing ./raises_on_import.py raised RuntimeError: missing config file at {d}/./raises_on_import.py:1",
        ),
    ],
    ids=["function_raises", "function_needs_arguments", "module_raises_on_import"],
)
@pytest.mark.parametrize("command", ["plan", "data stats"])
def test_a_model_module_that_raises_is_one_line_naming_it_and_where(model_dir, capsys, target, says, command):
    where = ["--topology", "v6e-4"]
    if command != "plan":
        where += [model_dir, "--out", model_dir / "o.json"]
    code, out, err = _run([*command.split(), *where, "--model-module", target], capsys)
    assert_refused(code, err, f"--model-module {target!r}: {says.format(d=model_dir)}")
    assert out == "" and not (model_dir / "o.json").exists()


@pytest.mark.parametrize(
    "text,says",
    [
        ('{"format": "tpurec-id-limits", "tab', "not JSON (Unterminated string"),
        ("[1, 2]", "not a limits file (write one with `tpurec data stats`)"),
        (
            '{"format": "tpurec-id-limits", "version": 1, "tables": {"t_C1": {"max_ids_per_partition": NaN, '
            '"max_unique_ids_per_partition": 8}}}',
            "t_C1",
        ),
    ],
    ids=["truncated", "a_list", "nan"],
)
def test_a_bad_limits_file_is_refused_before_any_data_is_made(tmp_path, capsys, monkeypatch, text, says):
    limits = tmp_path / "limits.json"
    limits.write_text(text)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TPUREC_CACHE", str(cache))
    code, _, err = _run(["train", "--synth-rows", "2100", "--steps", "1", "--limits", limits], capsys)
    assert_refused(code, err, f"tpurec train: error: --limits {limits}")
    assert says in err
    # was: the one-process trainer made the synthetic dataset first, then refused the file
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize(
    "slice_name,says",
    [
        ("foo-8", "--emulate-tpu: unknown TPU generation 'foo' in 'foo-8'"),
        ("v6e-3", "--emulate-tpu: 'v6e-3' is not a Cloud TPU v6e slice"),
        ("v5p-100000000", "--emulate-tpu: 'v5p-100000000': 50,000,000 chips, but a v5p slice is at most 6,144"),
    ],
)
def test_launch_refuses_a_slice_it_cannot_emulate_before_any_rank(tmp_path, capsys, slice_name, says):
    prog = tmp_path / "prog.py"
    prog.write_text("open(__file__ + '.ran', 'w')\n")
    code, out, err = _run(["launch", "--emulate-tpu", slice_name, prog], capsys)
    assert_refused(code, err, f"tpurec launch: error: {says}")
    assert out == "" and not (tmp_path / "prog.py.ran").exists()


def test_limits_of_another_layout_name_only_the_fields_the_file_gives(tmp_path):
    from tpurec.planner.id_limits import FORMAT, IdLimitsError, load_limits

    entry = {"max_ids_per_partition": 16, "max_unique_ids_per_partition": 8}
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"format": FORMAT, "version": 1, "layout": {"world_size": 4}, "tables": {"t": entry}}))
    ours = {"world_size": 2, "sparsecores_per_device": 4, "batch_size_per_device": 512}
    with pytest.raises(IdLimitsError) as e:
        load_limits(str(limits), ours)
    # was: "4 device(s), None SparseCores each, batch None per device"
    assert str(e.value) == (
        f"--limits {limits} was measured for 4 device(s), not 2 device(s), 4 SparseCores each, batch 512 per device"
    )
