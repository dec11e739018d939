"""The layout as the design states it: imports only go downward, and each folder keeps to
its side of a seam. Read from the source (every import, also those inside functions), so a
lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLAIT = Path(__file__).resolve().parent.parent / "plait"


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


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


# The layers, top to bottom: a module may import its own layer and those below it, through
# any chain. The torch-free model shapes sit below the estimator that reads them; the
# strategies (parallel) below the model families that answer their questions.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry", ("plait.cli", "plait.__main__")),
    ("families", ("plait.families",)),
    ("train", ("plait.train",)),
    ("report", ("plait.report",)),
    ("api", ("plait.api",)),
    ("bench", ("plait.bench",)),
    ("models", ("plait.models",)),
    ("parallel", ("plait.parallel",)),
    ("estimate", ("plait.estimate",)),
    ("shapes", ("plait.models.gpt.config", "plait.models.resnet.config", "plait.models.hf.config")),
    ("runtime", ("plait.runtime",)),
    ("base", ("plait", "plait.errors", "plait.wire", "plait.balance", "plait.interleave", "plait.rules",
              "plait.layout", "plait.schedule")),
]
# What a layer must not reach even below it: the seams. The strategies know no model, not
# even a shape; the estimator is pure arithmetic (no torch.distributed, no strategy).
SEAMS = {"parallel": ("plait.models",), "estimate": ("plait.runtime", "plait.parallel")}
# What a layer must not import itself, though it may reach it through a module below: the loop
# (and the families' tasks beside it) runs whatever parallelize applied through the executor
# (plait.parallel.executor) and its step hooks, never a strategy's own module.
STRATEGIES = tuple(f"plait.parallel.{name}" for name in ("data", "zero", "tensor", "pipeline", "context", "expert"))
DIRECT_SEAMS = {"train": STRATEGIES, "families": STRATEGIES}


def layer_of(module: str) -> int:
    """The index of the most specific layer naming `module` (or a package above it)."""
    best, depth = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


def reach(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{module: every module it imports through any chain}."""
    out: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        out[start] = seen - {start}
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every (module, what it reaches) where the second sits in a higher layer, or breaks a seam."""
    found = []
    for module, reached in sorted(reach(graph).items()):
        mine = layer_of(module)
        for other in sorted(reached):
            if layer_of(other) < mine:
                found.append(f"{module} ({LAYERS[mine][0]}) reaches {other} ({LAYERS[layer_of(other)][0]})")
            elif any(other.startswith(p) for p in SEAMS.get(LAYERS[mine][0], ())):
                found.append(f"{module} ({LAYERS[mine][0]}) reaches {other} across a seam")
    return found


def direct_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every (module, what it imports itself) that crosses its layer's direct seam."""
    found = []
    for module, imported in sorted(graph.items()):
        banned = DIRECT_SEAMS.get(LAYERS[layer_of(module)][0], ())
        found += [f"{module} imports {other}" for other in sorted(imported)
                  if any(other == p or other.startswith(p + ".") for p in banned)]
    return found


def test_the_loop_imports_no_strategy() -> None:
    assert direct_crossings(imports()) == []


def test_a_strategy_imported_by_the_loop_is_found() -> None:
    """A planted import of expert parallelism in the trainer; the executor may import it."""
    graph = {"plait.train.loop.trainer": {"plait.parallel.executor", "plait.parallel.expert.plan"},
             "plait.parallel.executor": {"plait.parallel.expert.plan"}, "plait.parallel.expert.plan": set()}
    assert direct_crossings(graph) == ["plait.train.loop.trainer imports plait.parallel.expert.plan"]
    assert direct_crossings({"plait.train.loop.run": {"plait.parallel.expert"}}) == [
        "plait.train.loop.run imports plait.parallel.expert"]


def test_every_module_has_a_layer() -> None:
    assert [m for m in imports() if layer_of(m) < 0] == []


def test_imports_only_go_down_through_any_chain() -> None:
    assert upward(imports()) == []


def test_an_upward_chain_is_found_however_long() -> None:
    """A planted chain: a base module imports a runtime one that imports the trainer."""
    graph = {"plait.rules": {"plait.runtime.comm"}, "plait.runtime.comm": {"plait.runtime.env"},
             "plait.runtime.env": {"plait.train.loop.trainer"}, "plait.train.loop.trainer": set()}
    assert upward(graph) == [
        "plait.rules (base) reaches plait.runtime.comm (runtime)",
        "plait.rules (base) reaches plait.runtime.env (runtime)",
        "plait.rules (base) reaches plait.train.loop.trainer (train)",
        "plait.runtime.comm (runtime) reaches plait.train.loop.trainer (train)",
        "plait.runtime.env (runtime) reaches plait.train.loop.trainer (train)"]
    # the strategies reaching a model's shape through the estimator, as pipeline/split.py did
    assert upward({"plait.parallel.pipeline.split": {"plait.estimate.layout"},
                   "plait.estimate.layout": {"plait.models.gpt.config"}, "plait.models.gpt.config": set()}) == [
        "plait.parallel.pipeline.split (parallel) reaches plait.models.gpt.config across a seam"]


def test_no_import_cycles_between_modules() -> None:
    graph = {m: {d for d in deps if d != "plait"} for m, deps in imports().items() if m != "plait"}
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
