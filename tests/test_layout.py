"""The layout as the design states it: imports only go downward, and each folder keeps to
its side of a seam. Read from the source (every import, also those inside functions), so a
lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PLAIT = Path(__file__).resolve().parent.parent / "plait"


def module_name(path: Path) -> str:
    parts = path.relative_to(PLAIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """{module: the plait modules it imports anywhere in its body}."""
    modules = {module_name(p): p for p in PLAIT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("plait"):
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found.update(submodules if len(submodules) == len(node.names) else {node.module, *submodules})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("plait"))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_modules() -> None:
    graph = {m: {d for d in deps if d != "plait"} for m, deps in imports().items() if m != "plait"}
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_strategies_import_no_model_and_runtime_no_estimate() -> None:
    for module, deps in imports().items():
        if module.startswith("plait.parallel"):
            assert not {d for d in deps if d.startswith("plait.models")}, module
        if module.startswith("plait.runtime"):
            assert not {d for d in deps if d.startswith(("plait.estimate", "plait.train", "plait.parallel"))}, module
        if module.startswith("plait.estimate"):
            assert not {d for d in deps if d.startswith(("plait.runtime", "plait.parallel", "plait.train"))}, module
