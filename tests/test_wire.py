"""The ring formula has one home below runtime/ and estimate/, and runtime/ imports no estimate/."""

from __future__ import annotations

import ast
from pathlib import Path

import plait
from plait import wire

PACKAGE = Path(plait.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_imports_nothing_from_estimate() -> None:
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        bad = {name for name in _imported_modules(path) if name.startswith("plait.estimate")}
        assert not bad, f"runtime/{path.name} imports {bad}"


def test_the_ring_formula_is_defined_once_and_torch_free() -> None:
    from plait.estimate import traffic as estimate_comm
    from plait.runtime import comm as runtime_comm

    assert estimate_comm.ring_bytes is wire.ring_bytes
    assert runtime_comm.ring_wire_bytes is wire.ring_bytes
    assert _imported_modules(Path(wire.__file__)) == {"__future__"}
    defining = [p for p in PACKAGE.rglob("*.py") if "def ring_bytes(" in p.read_text()]
    assert defining == [Path(wire.__file__)]
    assert wire.ring_bytes("all_reduce", 1000, 4) == 1500.0
