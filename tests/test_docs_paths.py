"""Every file the docs name exists, so a move or a rename cannot leave the docs pointing at nothing.

Read as text (no plait or torch import): README.md, docs/**/*.md and benchmarks/RESULTS.md; the paths
may be under plait/, tests/, benchmarks/ or examples/.
Checked, wherever they appear:
- `plait/...` paths (a file, a folder ending in `/`, or a glob like `plait/models/hf/*.py`);
- `tests/...py` and `benchmarks/...py` paths;
- backticked names and partial paths (`launch.py`, `parallel/clip.py`, `pipeline*.py`): some
  file under plait/, benchmarks/ or tests/ ends with that name or path;
- dotted names (`plait.parallel.zero.stages.full_parameters`): each package and module on the
  way exists, and the first name after the last one is in its source;
and docs/design.md's layer map names every module of plait/.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("plait", "benchmarks", "tests", "examples")
FULL_PATH = re.compile(r"(?<![\w/.-])(?:plait|tests|benchmarks|examples)/[\w/*.-]*")
BACKTICKED = re.compile(r"`([\w*][\w/*.-]*\.py)`")
DOTTED = re.compile(r"(?<![\w./-])plait(?:\.\w+)+")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]


def code_files() -> list[str]:
    """Every .py under plait/, benchmarks/ and tests/, as a path from the repository root."""
    return sorted(p.relative_to(ROOT).as_posix() for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def full_path_exists(path: str) -> bool:
    """A folder, a file, or a glob that matches at least one file."""
    if "*" in path:
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file()


def tail_exists(name: str, files: list[str]) -> bool:
    """Some code file's path ends with `name` (whole components; `*` as in a shell)."""
    return any(fnmatch(f, name) or fnmatch(f, f"*/{name}") for f in files)


def dotted_exists(name: str) -> bool:
    """`plait.a.b.c`: walk packages, stop at the first module file; a name that is neither must be
    in its package's __init__.py (a lazy export), a name after a module must be in that module."""
    here = ROOT / "plait"
    parts = name.split(".")[1:]
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        source = here / f"{part}.py"
        if source.is_file():
            rest = parts[i + 1:]
            return not rest or re.search(rf"\b{rest[0]}\b", source.read_text()) is not None
        init = here / "__init__.py"
        return init.is_file() and re.search(rf"\b{part}\b", init.read_text()) is not None
    return True


def missing_names(text: str, files: list[str]) -> list[tuple[int, str]]:
    """(line, name) for each name in `text` that points at nothing."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        full = [p for p in (m.rstrip(".-") for m in FULL_PATH.findall(line)) if p.endswith((".py", "/"))]
        found += [(number, p) for p in full if not full_path_exists(p)]
        found += [(number, p) for p in BACKTICKED.findall(line)
                  if p not in full and not p.startswith(("plait/", "tests/", "benchmarks/"))
                  and not tail_exists(p, files)]
        found += [(number, d) for d in DOTTED.findall(line) if not dotted_exists(d)]
    return found


def test_every_file_the_docs_name_exists() -> None:
    files = code_files()
    missing = [f"{page.relative_to(ROOT)}:{line}: {name}"
               for page in pages() for line, name in missing_names(page.read_text(), files)]
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_a_stale_name() -> None:
    files = code_files()
    text = ("`plait/parallel/zero_optim.py` and `plait/parallel/nothing/` and `tensor_cost.py`,\n"
            "`parallel/nowhere.py`, `plait/models/nope_*.py`, plait.parallel.zero_shard.pack,\n"
            "plait.parallel.zero.optim.no_such_name; fine: `plait/parallel/zero/optim.py`, `launch.py`,\n"
            "`pipeline/split.py`, `plait/models/hf/*.py`, `plait/parallel/tensor/`, plait.parallelize\n")
    assert sorted(name for _, name in missing_names(text, files)) == sorted([
        "plait/parallel/zero_optim.py", "plait/parallel/nothing/", "tensor_cost.py", "parallel/nowhere.py",
        "plait/models/nope_*.py", "plait.parallel.zero_shard.pack", "plait.parallel.zero.optim.no_such_name"])


def test_the_layer_map_names_every_module() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    unnamed = [f for f in code_files()
               if f.startswith("plait/") and not f.endswith("/__init__.py") and Path(f).name not in design]
    assert not unnamed, "docs/design.md's layer map does not name: " + ", ".join(unnamed)
