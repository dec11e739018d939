"""Run a multi-process "world" from a test and collect what each rank reports.

Spawning costs seconds (mostly `import torch`), so a world script checks many things at
once and writes one JSON file per rank; the test then asserts on those numbers. Scripts live
in tests/worlds/ and are started with `plait launch`, which exercises the spawner too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from collections.abc import Callable, Collection, Iterable
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLDS = ROOT / "tests" / "worlds"


def run_world(script: str, nproc: int, out: Path, *args: str, timeout: float = 300,
              expect_ok: bool = True) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """Run tests/worlds/`script` on `nproc` ranks; return the process and each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PLAIT_TEST_OUT": str(out), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "plait", "launch", "--nproc", str(nproc), str(WORLDS / script), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, f"world {script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    reports = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return proc, reports


def save_report(report: dict[str, Any]) -> None:
    """Called inside a world script: write this rank's findings for the test to read."""
    path = Path(os.environ["PLAIT_TEST_OUT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(report))


def run_plait(*args: str, timeout: float = 300, cwd: Path | None = None,
              env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the `plait` CLI as a user would (python -m plait ...)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_SPAWNED"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "plait", *args], env=env, cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)


def split_slow(names: Iterable[str], fast: Collection[str]) -> list[Any]:
    """Parameters for a parametrized test: those in `fast` run in `make test`, the others are
    marked slow (`make test-all`). Each name must exist, so a renamed case cannot drop out."""
    import pytest

    names = list(names)
    missing = set(fast) - set(names)
    assert not missing, f"unknown fast cases: {sorted(missing)}"
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in names]


class Runs:
    """Lazily computed runs shared by a module's tests: each key is run once, on first use,
    so a run needed only by slow tests costs nothing in `make test`."""

    def __init__(self, make: Callable[[Any], Any]):
        self._make = make
        self._done: dict[Any, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        if key not in self._done:
            self._done[key] = self._make(key)
        return self._done[key]
