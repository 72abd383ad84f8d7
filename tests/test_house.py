"""The house rules that keep tpurec/ readable, checked from the source (issue 62, "guards as tests").

- No function or method over MAX_LINES lines (its `def` line to its last, decorators excluded).
- Strict typing (disallow_untyped_defs) by package wildcard in pyproject.toml: every package is
  `tpurec.<pkg>.*`, so a module added to one is strict by default; each module excepted from it is
  listed on a line of its own with a comment giving the reason.
"""

from __future__ import annotations

import ast
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
