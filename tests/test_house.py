"""The house rules that keep tpurec/ readable, checked from the source (issue 62, "guards as tests").

- No function or method over MAX_LINES lines (its `def` line to its last, decorators excluded).
- Strict typing (disallow_untyped_defs) by package wildcard in pyproject.toml: every package is
  `tpurec.<pkg>.*`, so a module added to one is strict by default; each module excepted from it is
  listed on a line of its own with a comment giving the reason.
- One word per idea: a device kind is compared against `tpurec.runtime.device.DeviceKind`, not
  written as "tpu" / "cpu" (fewer than MAX_DEVICE_STRINGS comparisons left, each not a device kind).
- `tpurec launch` is its own room: nothing in tpurec/launch* imports a module of tpurec/dlrm
  (`tpurec train` launches its ranks through tpurec/launch, not the other way round).
- The Trainer is composed of small parts: its class body under MAX_PART_LINES lines, and every
  module of its parts (tpurec/dlrm/training/) under MAX_PART_LINES lines.
- The training steps' room (tpurec/sharding/step/): every module under MAX_PART_LINES lines.
- Each optimizer's direct CPU step is a method of its spec: tpurec/embedding/direct.py reads no
  optimizer's name (no `spec.name == ...` branches, no tables keyed by it).
- Tests mirror the package and share helpers through tests/helpers/: no module under tests/ imports
  from a test module (`test_*.py`).
- Duplicate code in tpurec/ no more than MAX_DUPLICATES blocks (pylint's duplicate-code checker),
  and falling.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpurec"
MAX_LINES = 120


def _long_functions(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            end = node.end_lineno
            assert end is not None  # (set by ast.parse)
            lines = end - node.lineno + 1  # lineno: the `def` line, after any decorator
            if lines > MAX_LINES:
                out.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_is_over_120_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        long += _long_functions(path.read_text(), str(path.relative_to(ROOT)))
    assert not long, f"functions over {MAX_LINES} lines (split them into parts with one job each): {long}"


def test_the_length_check_counts_from_the_def_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    fits = "@decorator\n@another\ndef f():\n" + body
    assert _long_functions(fits, "m") == []
    assert _long_functions(fits + "    y = 0\n", "m") == [f"m:3 f ({MAX_LINES + 1} lines)"]


def _overrides() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]


def _strict_patterns() -> set[str]:
    out: set[str] = set()
    for o in _overrides():
        if o.get("disallow_untyped_defs") is True:
            out |= set(o["module"])
    return out


def _excepted() -> list[str]:
    out: list[str] = []
    for o in _overrides():
        if o.get("disallow_untyped_defs") is False:
            out += o["module"]
    return out


def test_every_package_is_strict_by_wildcard():
    """Each package under tpurec/ by `tpurec.<pkg>.*` (a new module joins strict typing by default),
    each top-level module by name; no module listed by hand inside a package."""
    strict = _strict_patterns()
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    missing = [f"tpurec.{p}.*" for p in packages if f"tpurec.{p}.*" not in strict]
    assert not missing, f"packages not strict by wildcard in pyproject.toml: {missing}"
    top = ["tpurec"] + sorted(f"tpurec.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert not [m for m in top if m not in strict], "top-level modules not in the strict list"
    by_hand = sorted(m for m in strict if m.startswith("tpurec.") and "*" not in m and m not in top)
    assert not by_hand, f"modules listed by hand (their package's wildcard covers them): {by_hand}"


def test_each_exception_to_strict_typing_says_why():
    """An excepted module names a module that exists, on a line of its own with its reason."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    for module in _excepted():
        path = PACKAGE.joinpath(*module.split(".")[1:])
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module
        line = next(line for line in lines if line.strip().startswith(f'"{module}",'))
        reason = line.partition("#")[2].strip()
        assert len(reason.split()) >= 3, f"{module}: the exception needs its reason in a comment"


# `== "tpu"`, `!= "cpu"`: a device kind written as a string. What is left (an op's namespace) is
# not a device kind; the bound keeps new ones from creeping back.
DEVICE_STRING = re.compile(r'[=!]= "(tpu|cpu)"')
MAX_DEVICE_STRINGS = 10


def _device_strings(source: str, name: str) -> list[str]:
    return [f"{name}:{i}" for i, line in enumerate(source.splitlines(), 1) if DEVICE_STRING.search(line)]


def test_device_kinds_are_compared_as_device_kind():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _device_strings(path.read_text(), str(path.relative_to(ROOT)))
    assert len(found) < MAX_DEVICE_STRINGS, (
        "compare against tpurec.runtime.device.DeviceKind (DeviceKind.TPU, DeviceKind.CPU) instead of "
        f"the strings: {found}"
    )


def test_the_device_string_check_sees_both_operators():
    source = 'if kind == "tpu":\n    pass\nif t.device.type != "cpu":\n    pass\nif kind == DeviceKind.TPU:\n'
    assert _device_strings(source, "m") == ["m:1", "m:3"]


def _imported_modules(source: str, name: str, root: str = "tpurec") -> set[str]:
    """Every module of package `root` that `name` imports, at module level or inside a function;
    `from pkg import x` counts as `pkg.x` (a module or a name in one: either way it reaches into pkg)."""
    package = name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] == root}


def _launch_modules() -> dict[str, Path]:
    paths = sorted(PACKAGE.glob("launch*.py")) + sorted((PACKAGE / "launch").rglob("*.py"))
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in paths}


def test_the_launcher_imports_nothing_from_dlrm():
    assert _launch_modules(), "tpurec/launch* is gone: update this check"
    bad = [
        f"{name} imports {target}"
        for name, path in _launch_modules().items()
        for target in sorted(_imported_modules(path.read_text(), name))
        if target == "tpurec.dlrm" or target.startswith("tpurec.dlrm.")
    ]
    assert not bad, f"tpurec launch must not depend on the DLRM app (move what it needs down): {bad}"


def test_the_import_check_sees_lazy_relative_and_from_imports():
    source = (
        "from tpurec import dlrm\n"
        "def f():\n    import tpurec.dlrm.cli\n    from ..dlrm.configs import X\n"
        "from .hosts import run_hosts\n"
    )
    assert _imported_modules(source, "tpurec.launch.cli") == {
        "tpurec.dlrm",
        "tpurec.dlrm.cli",
        "tpurec.dlrm.configs.X",
        "tpurec.launch.hosts.run_hosts",
    }


MAX_PART_LINES = 300
TRAINER = PACKAGE / "dlrm" / "trainer.py"
TRAINER_PARTS = PACKAGE / "dlrm" / "training"
STEPS = PACKAGE / "sharding" / "step"  # the training steps' room


def _class_lines(source: str, name: str) -> int:
    """Lines of class `name` in `source`, its `class` line to its last (decorators excluded)."""
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    assert node.end_lineno is not None  # (set by ast.parse)
    return node.end_lineno - node.lineno + 1


def _long_modules(sources: dict[str, str]) -> list[str]:
    """The modules in `sources` (name: text) of MAX_PART_LINES lines or more."""
    return [f"{name} ({n} lines)" for name, text in sources.items() if (n := len(text.splitlines())) >= MAX_PART_LINES]


def test_the_trainer_is_small_parts():
    lines = _class_lines(TRAINER.read_text(), "Trainer")
    assert lines < MAX_PART_LINES, f"Trainer is {lines} lines: move a job into a part of {TRAINER_PARTS.name}/"
    parts = sorted(TRAINER_PARTS.glob("*.py"))
    assert len(parts) > 5, f"{TRAINER_PARTS} is gone: update this check"
    long = _long_modules({p.name: p.read_text() for p in parts})
    assert not long, f"parts of the Trainer over {MAX_PART_LINES} lines (split them): {long}"


def test_the_class_length_check_counts_the_class_alone():
    source = "x = 1\n@dataclass\nclass A:\n    a: int\n    b: int\n\n\ndef f():\n    pass\n"
    assert _class_lines(source, "A") == 3


def test_the_training_steps_are_small_modules():
    modules = sorted(STEPS.glob("*.py"))
    assert len(modules) > 5, f"{STEPS} is gone: update this check"
    long = _long_modules({p.name: p.read_text() for p in modules})
    assert not long, f"modules of {STEPS.relative_to(ROOT)}/ over {MAX_PART_LINES} lines (split them): {long}"


def test_the_module_length_check_counts_every_line():
    fits, over = "x = 1\n" * (MAX_PART_LINES - 1), '"""doc"""\n\n' + "x = 1\n" * (MAX_PART_LINES - 2)
    assert _long_modules({"a.py": fits, "b.py": over}) == [f"b.py ({MAX_PART_LINES} lines)"]


def _optimizer_name_reads(source: str) -> list[int]:
    """Lines reading an optimizer spec's name: `spec.name` or `<...>.optimizer.name`."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr == "name"
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "spec")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "optimizer")
        )
    )


def test_the_direct_step_does_not_branch_on_the_optimizers_name():
    direct = PACKAGE / "embedding" / "direct.py"
    found = _optimizer_name_reads(direct.read_text())
    assert not found, (
        f"{direct.relative_to(ROOT)} reads the optimizer's name on lines {found}: put that optimizer's step in "
        "its spec (OptimizerSpec.direct_update / direct_fields, tpurec/embedding/optimizers/)"
    )


def test_the_name_check_sees_branches_and_lookups():
    source = 'if spec.name == "adam":\n    pass\nk = T.get(kernel.optimizer.name)\nspec.direct_update(h)\nt.name\n'
    assert _optimizer_name_reads(source) == [1, 3]


TESTS = ROOT / "tests"


def _test_module_imports(source: str, name: str) -> list[str]:
    """The test modules (`tests...test_*`) module `name` imports, at module level or in a function."""
    imported = _imported_modules(source, name, "tests")
    return sorted(m for m in imported if any(part.startswith("test_") for part in m.split(".")))


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found += [f"{name} imports {m}" for m in _test_module_imports(path.read_text(), name)]
    assert not found, f"move what test modules share into tests/helpers/ (or a directory's helpers.py): {found}"


def test_the_test_import_check_sees_relative_absolute_and_lazy_imports():
    source = (
        "from .test_a import x\nfrom tests.b.test_c import y\nfrom ..helpers.frames import f\n"
        "def g():\n    import tests.test_d\n    from . import test_e\n"
    )
    assert _test_module_imports(source, "tests.b.test_z") == [
        "tests.b.test_a.x",
        "tests.b.test_c.y",
        "tests.b.test_e",
        "tests.test_d",
    ]


# pylint's duplicate-code checker (R0801, its `Symilar`): blocks of 6 or more lines that stand in two
# places, comments, docstrings, imports and signatures left out (pylint's defaults); each block a pair.
# The same 12 pairs as `pylint --disable=all --enable=duplicate-code --min-similarity-lines=6 tpurec`, which
# takes 38 s here on 2 cores (its astroid parse runs astroid's inference plugins, which parse torch too).
# Here each module is parsed once, without them (`apply_transforms=False`: Symilar reads from the tree
# only where the imports and the signatures are) and without the builder's pass over `self.x = ...`
# assignments, which infers each `self` and so parsed torch and TorchRec all the same (22 of the 28 s
# this test took): 3 to 5 s.
MAX_DUPLICATES = 12  # today's count (the 56 is another tool's, which counts shapes too): only lower it
DUPLICATE = re.compile(r"^(\d+) similar lines in (\d+) files$", re.MULTILINE)


def _duplicate_blocks(files: list[Path]) -> list[str]:
    """pylint's duplicate-code report on `files`: one line a block (its size, how many places)."""
    try:
        from astroid.builder import AstroidBuilder
        from astroid.manager import AstroidManager
        from pylint.checkers.symilar import Symilar
    except ImportError as e:
        raise AssertionError(f"{e}: pylint is a test dependency (requirements/test.txt); run make install") from e

    class TreeOnly(AstroidBuilder):
        def delayed_assattr(self, node):  # the attributes' owners, by inference: Symilar never asks
            pass

    builder = TreeOnly(AstroidManager(), apply_transforms=False)
    symilar = Symilar(
        min_lines=6, ignore_comments=True, ignore_docstrings=True, ignore_imports=True, ignore_signatures=True
    )
    for path in files:
        text = path.read_text()
        tree = builder.string_build(text)  # as astroid.parse(text, apply_transforms=False), less the inference
        symilar.append_stream(str(path), io.StringIO(text), tree=tree)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        symilar.run()
    return [m.group(0) for m in DUPLICATE.finditer(report.getvalue())]


def test_duplicate_code_is_not_growing():
    blocks = _duplicate_blocks(sorted(PACKAGE.rglob("*.py")))
    assert len(blocks) <= MAX_DUPLICATES, (
        f"{len(blocks)} blocks of duplicate code in tpurec/, more than {MAX_DUPLICATES} (serve both places from "
        "one piece of code); see them: .venv/bin/pylint --disable=all --enable=duplicate-code "
        "--min-similarity-lines=6 tpurec"
    )


def test_the_duplicate_check_counts_a_copied_block(tmp_path):
    body = "".join(f"    x{i} = y * {i}\n" for i in range(8))
    (tmp_path / "a.py").write_text(f"import os\nimport re\nimport sys\n\n\ndef f(y):\n{body}    return x0\n")
    (tmp_path / "b.py").write_text(f"import os\nimport re\nimport sys\n\n\ndef g(y):\n    z = 1\n{body}    return z\n")
    assert _duplicate_blocks(sorted(tmp_path.glob("*.py"))) == ["8 similar lines in 2 files"]
