"""The layering of docs/architecture.md, checked from the source: no upward imports, no cycles.

Every `import` and `from ... import` in every module counts, at module level or inside a function
(a lazy import is still a dependency). `from pkg import name` points at `pkg.name` when that is a
module, else at `pkg` itself. String-based imports (`importlib.import_module("...")`, used by the
command registry) are not seen; they live only in facades and in `tpurec/cli.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tpurec"

# Top-level part of tpurec -> layer. Modules of the same layer may import each other only inside
# the same part (embedding and data are both L1 and independent).
LAYERS = {
    "errors": -1,  # the user-error type (tpurec/errors.py): imported by every layer, imports nothing
    "strict_json": -1,  # the JSON every layer writes (NaN as null, never NaN): imports nothing
    "runtime": 0,  # process and host plumbing: device, process groups, heartbeat, threads, locks, signals
    "argtypes": 0,
    "outputs": 0,
    "json_fields": 0,
    "embedding": 1,
    "data": 1,
    "planner": 2,
    "sharding": 3,
    "emulation": 3,  # a TPU rank on CPU: TorchTPU's stand-ins over embedding, slices from the planner
    "launch": 3.5,  # a program's ranks on a slice (`tpurec launch`, `tpurec train`'s ranks): under dlrm
    "dlrm": 4,
    "bench": 5,
    "cli": 5,
    "env_report": 5,
    "selftest": 5,
}
FACADE = "tpurec"  # the root __init__: above every layer


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(target module, line, imported name or '') for every tpurec import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, "") for a in node.names if a.name.split(".")[0] == "tpurec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tpurec":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, node.lineno, "") if sub in modules else (source, node.lineno, alias.name))
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def _layer(module: str) -> float:
    part = _part(module)
    if part == FACADE:
        return 99
    if part not in LAYERS:
        raise AssertionError(f"{module}: tpurec.{part} has no layer in LAYERS (add it, and to docs/architecture.md)")
    return LAYERS[part]


def _edges():
    modules = _modules()
    for name, path in sorted(modules.items()):
        for target, line, imported in _imports(name, path, modules):
            yield name, path, line, target, imported


def test_every_part_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_import_runs_up_a_layer():
    bad = []
    for source, path, line, target, imported in _edges():
        if _part(source) == FACADE:
            continue  # the facade sits above everything
        if _part(target) == FACADE:
            if imported != "__version__":
                bad.append(f"{path.name}:{line} {source} imports {imported or 'tpurec'} from the tpurec facade")
            continue
        up = _layer(target) > _layer(source)
        sideways = _layer(target) == _layer(source) and _part(target) != _part(source)
        if up or sideways:
            bad.append(
                f"{path.relative_to(PACKAGE.parent)}:{line} {source} (L{_layer(source)}) -> "
                f"{target} (L{_layer(target)})"
            )
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for source, _, _, target, _ in _edges():
        if target != source:
            graph.setdefault(source, set()).add(target)
    cycles = _strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative; returns the components with more than one module."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    nodes = set(graph) | {t for ts in graph.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.add(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


@pytest.mark.parametrize(
    "graph,expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [{"a", "b"}]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [{"a", "b", "c"}]),
        ({"a": {"b"}, "b": {"c"}}, []),
    ],
)
def test_cycle_finder_finds_cycles(graph, expected):
    assert sorted(map(sorted, _strongly_connected(graph))) == sorted(map(sorted, expected))


# The kernel seam (tpurec/embedding/kernel_protocol.py): the concrete kernels' modules, and the
# classes they define, which only embedding/ itself names (kernel_kinds.py picks one for the sharded
# lookups). bench/ times the SparseCore kernel itself, so it may name it.
CONCRETE_KERNEL_MODULES = {"tpurec.embedding.kernel", "tpurec.embedding.sequence_kernel"}
CONCRETE_KERNEL_CLASSES = {"SparseCoreKernel", "SparseCoreSequenceKernel"}
MAY_NAME_A_KERNEL = {"embedding", "bench"}


def _concrete_kernel_imports(edges) -> list[str]:
    bad = []
    for source, path, line, target, imported in edges:
        if _part(source) in MAY_NAME_A_KERNEL or _part(source) == FACADE:
            continue
        if target in CONCRETE_KERNEL_MODULES or imported in CONCRETE_KERNEL_CLASSES:
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} {source} -> {target} {imported}".rstrip())
    return bad


def test_only_embedding_names_a_concrete_kernel():
    bad = _concrete_kernel_imports(_edges())
    assert not bad, (
        "import the kernel protocol (tpurec.embedding.kernel_protocol) and pick a class through "
        "tpurec.embedding.kernel_kinds instead:\n" + "\n".join(bad)
    )


def test_the_kernel_seam_check_sees_concrete_imports():
    # the check itself: a sharding module naming the kernel, its module, or the sequence kernel's
    here = PACKAGE / "sharding" / "kernel_module.py"
    edges = [
        ("tpurec.sharding.kernel_module", here, 1, "tpurec.embedding.kernel", "SparseCoreKernel"),
        ("tpurec.sharding.rank_limits", here, 2, "tpurec.embedding.sequence_kernel", ""),
        ("tpurec.sharding.kernel_module", here, 3, "tpurec.embedding.kernel_kinds", ""),
        ("tpurec.embedding.kernel_kinds", here, 4, "tpurec.embedding.kernel", "SparseCoreKernel"),
    ]
    found = [b.split()[1] for b in _concrete_kernel_imports(edges)]
    assert found == ["tpurec.sharding.kernel_module", "tpurec.sharding.rank_limits"]
