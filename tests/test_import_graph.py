"""The package's import graph, read from its source (every import statement, the ones inside functions included).

Imports only the standard library: it reads files, it imports nothing of the package. An edge ``a -> b`` is a
statement in ``a`` that imports ``b``; importing a submodule implicitly imports its parent package first, which is
not an edge (it is a consequence of the package structure, not a dependency of the code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

PACKAGE = "torchmetrics_gradpatch"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: The core: the version gate, the target, the gathers, the modes, the replaced class attributes, the sync
#: strategies' replacement, the engine, the switches and the status. It imports only itself (the gathers lazily, to
#: keep the import torch-free); features register with it and are never imported by it.
CORE = {
    f"{PACKAGE}.{name}"
    for name in (
        "_errors",
        "_version",
        "_compile",
        "_modes",
        "_target",
        "_gather",
        "_global",
        "_bytes",
        "_site",
        "_syncs",
        "_engine",
        "_blocks",
        "_api",
        "_status",
    )
}
#: The features, each a subpackage: what each may import besides the core and itself.
FEATURES = {f"{PACKAGE}.fused": set(), f"{PACKAGE}.cli": {f"{PACKAGE}.fused"}}
#: What the core may import lazily, inside a function: the two gathers (they import torch).
LAZY_ALLOWED = {f"{PACKAGE}._modes": {f"{PACKAGE}._gather", f"{PACKAGE}._global"}}


def _feature(module: str) -> str | None:
    return next((f for f in FEATURES if module == f or module.startswith(f + ".")), None)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Every module's imports of package modules, and (separately) those made inside a function body."""
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    lazy: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                if target in modules and target != name:
                    edges[name].add(target)
                    if id(node) in in_function:
                        lazy[name].add(target)
    return edges, lazy


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_sees_lazy_imports_and_cycles() -> None:
    """The control: the reader finds an import made inside a function of this package, and a two-module cycle."""
    _, lazy = import_graph()
    assert f"{PACKAGE}._gather" in lazy[f"{PACKAGE}._modes"], lazy[f"{PACKAGE}._modes"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_core_imports_one_way() -> None:
    edges, lazy = import_graph()
    core_edges = {name: {t for t in edges[name] if t in CORE} for name in CORE}
    assert cycles(core_edges) == []
    for name in sorted(CORE):
        outside = edges[name] - CORE - LAZY_ALLOWED.get(name, set())
        assert not outside, f"{name} imports {sorted(outside)} from outside the core"
        assert lazy[name] <= LAZY_ALLOWED.get(name, set()), f"{name} imports {sorted(lazy[name])} inside a function"
    assert edges[f"{PACKAGE}._errors"] == set(), "the errors module imports nothing of the package"
    assert edges[f"{PACKAGE}._compile"] == set(), "the torch.compile shim is a leaf"


def test_every_module_is_the_core_a_feature_or_the_facade() -> None:
    modules = set(_modules())
    assert modules - CORE - {PACKAGE, f"{PACKAGE}.__main__"} == {m for m in modules if _feature(m)}, sorted(modules)
    assert modules >= CORE, sorted(CORE - modules)


def test_a_feature_imports_the_core_and_itself_only() -> None:
    edges, _ = import_graph()
    for name, targets in sorted(edges.items()):
        feature = _feature(name)
        if feature is None:
            continue
        allowed = CORE | FEATURES[feature]
        outside = {t for t in targets if t not in allowed and _feature(t) != feature}
        outside = {t for t in outside if not any(t == a or t.startswith(a + ".") for a in FEATURES[feature])}
        assert not outside, f"{name} imports {sorted(outside)}"


def test_the_package_import_graph_has_no_cycle() -> None:
    """The whole package, features included (the package's ``__init__`` imports the CLI's refusal printer on the
    refused-import path, so the CLI must import the core modules it needs, not the package)."""
    edges, _ = import_graph()
    assert cycles(edges) == [], {name: sorted(targets) for name, targets in edges.items() if targets}
