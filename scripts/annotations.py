"""How much of a package is annotated: a function counts as fully annotated when its return and every
parameter (a method's self/cls aside) are. Prints the share over all functions, over the public ones
(no leading underscore, in modules without one), and the modules that are complete: the candidates for
the `disallow_untyped_defs` list of [tool.mypy] in pyproject.toml.

    .venv/bin/python scripts/annotations.py [tpurec] [--missing]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _functions(tree: ast.AST) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool, bool]]:
    """(function, is a method, is private) for every def, nested ones included."""
    out: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool, bool]] = []

    def visit(node: ast.AST, in_class: bool, private: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dunder = child.name.startswith("__") and child.name.endswith("__")
                hidden = private or (child.name.startswith("_") and not dunder)
                out.append((child, in_class, hidden))
                visit(child, False, hidden)
            elif isinstance(child, ast.ClassDef):
                visit(child, True, private or child.name.startswith("_"))
            else:
                visit(child, in_class, private)

    visit(tree, False, False)
    return out


def _annotated(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> bool:
    args = fn.args
    params = args.posonlyargs + args.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not static and params and params[0].arg in ("self", "cls"):
        params = params[1:]
    params = params + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return fn.returns is not None and all(p.annotation is not None for p in params)


def main(argv: list[str]) -> int:
    root = Path(next((a for a in argv if not a.startswith("--")), "tpurec"))
    total = full = pub_total = pub_full = 0
    complete, missing = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        private_module = any(p.startswith("_") and p not in ("__init__.py", "__main__.py") for p in rel.parts)
        found = _functions(ast.parse(path.read_text()))
        done = [_annotated(fn, method) for fn, method, _ in found]
        total, full = total + len(found), full + sum(done)
        for (fn, _, private), ok in zip(found, done):
            if not (private or private_module):
                pub_total, pub_full = pub_total + 1, pub_full + ok
            if not ok:
                missing.append(f"{path}:{fn.lineno} {fn.name}")
        if all(done):
            complete.append(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
    print(
        f"{root}: {full}/{total} functions fully annotated ({100 * full / max(total, 1):.1f}%), "
        f"public {pub_full}/{pub_total} ({100 * pub_full / max(pub_total, 1):.1f}%)"
    )
    print(f"complete modules ({len(complete)}): {' '.join(complete)}")
    if "--missing" in argv:
        print("\n".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
