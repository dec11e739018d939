"""Run a multi-process "world" from a test and collect what each rank reports.

Spawning costs seconds (mostly `import torch`), so a world script checks many things at
once and writes one JSON file per rank; the test then asserts on those numbers. Scripts live
in tests/worlds/. Their ranks are forked from a pool process that imported torch and plait
once for the whole session (tests/zygote.py), each rank with the environment plait's
spawner gives it; a world expected to fail runs under `plait launch` itself, whose messages
about failing ranks are what such tests read (the spawner's own tests, test_launch*.py,
test_faults*, always use real processes). PLAIT_TEST_POOL=0 runs every world under
`plait launch`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
    pool = Pool.get() if expect_ok and os.environ.get("PLAIT_TEST_POOL", "1") != "0" else None
    if pool is not None and pool.serves(env):
        proc = pool.run_world(str(WORLDS / script), list(args), nproc, env, timeout)
    else:
        cmd = [sys.executable, "-m", "plait", "launch", "--nproc", str(nproc), str(WORLDS / script), *args]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, f"world {script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    reports = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return proc, reports


class Pool:
    """The session's zygote (tests/zygote.py), started on first use, and worlds run on it."""

    _instance: "Pool | None" = None
    # Variables read when torch or plait is imported, which the pool imported already with
    # its own: a world whose environment differs in one of them runs under `plait launch`.
    READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP", "MKL", "KMP", "ATEN", "CUDA", "NCCL", "GLOO", "PLAIT_LOG")

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="plait-pool-"))
        path = str(self.dir / "zygote.sock")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", path], cwd=ROOT, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "zygote.log", "w"))
        deadline = time.time() + 120
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the test pool did not start: {(self.dir / 'zygote.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.stream = self.sock.makefile("rw")
        self.worlds = 0
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "Pool":
        if cls._instance is None:
            cls._instance = Pool()
        return cls._instance

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a world with `env` can start from the pool's imports."""
        names = {k for k in {**env, **self.env} if k.startswith(self.READ_AT_IMPORT)}
        return all(env.get(k) == self.env.get(k) for k in names)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.stream.write(json.dumps(request) + "\n")
        self.stream.flush()
        return json.loads(self.stream.readline())

    def run_world(self, script: str, args: list[str], nproc: int, env: dict[str, str],
                  timeout: float) -> subprocess.CompletedProcess:
        """What `plait launch --nproc N script args` does for a world that succeeds: the ranks
        with the spawner's variables, stopped all when one fails (its exit code is the world's)."""
        from plait.runtime.launch import free_port, rank_env

        self.worlds += 1
        logs = self.dir / f"world{self.worlds}"
        logs.mkdir()
        port, faults = free_port(), tempfile.mkdtemp(prefix="plait-faults-")
        pids = []
        for rank in range(nproc):
            rank_vars = {**rank_env(rank, nproc, port), **env, "PLAIT_FAULT_DIR": faults, "PLAIT_RESTART": "0"}
            pids.append(self.ask({"run": script, "argv": args, "env": rank_vars, "cwd": str(ROOT),
                                  "log": str(logs / f"rank{rank}")})["pid"])
        code = self._wait(pids, time.time() + timeout)
        stdout = "".join((logs / f"rank{r}.stdout").read_text() for r in range(nproc))
        stderr = "".join((logs / f"rank{r}.stderr").read_text() for r in range(nproc))
        if code is None:
            raise subprocess.TimeoutExpired(script, timeout, stdout, stderr)
        return subprocess.CompletedProcess([script, *args], code, stdout, stderr)

    def _wait(self, pids: list[int], deadline: float) -> int | None:
        """The world's exit code (the first failure's), or None when it ran past `deadline`."""
        codes: dict[int, int] = {}
        first_failure = None
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes and (code := self.ask({"poll": pid})["code"]) is not None:
                    codes[pid] = code
                    if code != 0 and first_failure is None:
                        first_failure = code
                        self._stop([p for p in pids if p not in codes])
            if time.time() > deadline:
                self._stop([p for p in pids if p not in codes])
                while len(codes) < len(pids):  # reaped, not left as zombies of the pool
                    codes.update({p: c for p in pids if p not in codes and (c := self.ask({"poll": p})["code"]) is not None})
                return None
            time.sleep(0.02)
        return first_failure or 0

    @staticmethod
    def _stop(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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
