"""Run a multi-process "world" from a test and collect what each rank reports.

Spawning costs seconds (mostly `import torch`), so a world script checks many things at
once and writes one JSON file per rank; the test then asserts on those numbers. Scripts live
in tests/worlds/. Their ranks are forked from a pool process that imported torch and plait
once for the whole session (tests/zygote.py), each rank with the environment plait's
spawner gives it. The `plait` command itself runs from the same pool (run_plait), its
spawner forking its ranks from the pre-imported command; a world expected to fail runs
that way under `plait launch`, whose messages about failing ranks are what such tests read.
Faulted, restarted and elastic runs use the pool too (a forked rank dies or hangs as an
exec'd one would); the launcher tests, the whole-job signal tests and the slow tier's
killed-rank restart and elastic resizes start new interpreters. PLAIT_TEST_POOL=0 runs every world under `plait launch`
and every command in new interpreters.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Callable, Collection, Iterable
from typing import Any

from tests.pairing import starting_processes

ROOT = Path(__file__).resolve().parent.parent
WORLDS = ROOT / "tests" / "worlds"


def run_world(script: str, nproc: int, out: Path, *args: str, timeout: float = 300,
              expect_ok: bool = True) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """Run tests/worlds/`script` on `nproc` ranks; return the process and each rank's report."""
    starting_processes(f"the world {script}")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PLAIT_TEST_OUT": str(out), "PYTHONPATH": str(ROOT)}
    pool = Pool.serving(env)
    launch = ["launch", "--nproc", str(nproc), str(WORLDS / script), *args]
    if pool is not None:
        proc = (pool.run_world(str(WORLDS / script), list(args), nproc, env, timeout) if expect_ok
                else pool.run_cli(launch, env, ROOT, timeout))
    else:
        proc = subprocess.run([sys.executable, "-m", "plait", *launch], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, f"world {script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    reports = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return proc, reports


class Pool:
    """The session's zygote (tests/zygote.py), started as the session begins (tests/conftest.py)
    or on first use, and worlds run on it."""

    _instance: "Pool | None" = None
    # Variables read when torch or plait is imported, which the pool imported already with
    # its own: a world whose environment differs in one of them runs under `plait launch`.
    READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP", "MKL", "KMP", "ATEN", "CUDA", "NCCL", "GLOO", "PLAIT_LOG")
    READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)  # Inductor reads it at each compile (its cache_dir())

    def __init__(self) -> None:
        """Start the zygote and return: it imports torch (seconds) while the caller goes on, and
        the first request waits for it (tests/conftest.py starts it as collection begins)."""
        self.dir = Path(tempfile.mkdtemp(prefix="plait-pool-"))
        self.path = str(self.dir / "zygote.sock")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path], cwd=ROOT, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "zygote.log", "w"))
        self.stream: Any = None
        self.runs = 0
        self.lock = threading.Lock()  # one request and its answer at a time: tests may run commands from threads
        atexit.register(self.close)

    def _connect(self) -> None:
        deadline = time.time() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the test pool did not start: {(self.dir / 'zygote.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
        self.stream = self.sock.makefile("rw")

    _starting = threading.Lock()

    @classmethod
    def get(cls) -> "Pool":
        with cls._starting:
            if cls._instance is None:
                cls._instance = Pool()
        return cls._instance

    @classmethod
    def serving(cls, env: dict[str, str]) -> "Pool | None":
        """The pool, when it is on (PLAIT_TEST_POOL is not 0) and can start a process with `env`."""
        if os.environ.get("PLAIT_TEST_POOL", "1") == "0":
            return None
        pool = cls.get()
        return pool if pool.serves(env) else None

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a world with `env` can start from the pool's imports."""
        names = {k for k in {**env, **self.env} if k.startswith(self.READ_AT_IMPORT) and k not in self.READ_WHEN_USED}
        return all(env.get(k) == self.env.get(k) for k in names)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if self.stream is None:
                self._connect()
            self.stream.write(json.dumps(request) + "\n")
            self.stream.flush()
            return json.loads(self.stream.readline())

    def run_world(self, script: str, args: list[str], nproc: int, env: dict[str, str],
                  timeout: float) -> subprocess.CompletedProcess:
        """What `plait launch --nproc N script args` does for a world that succeeds: the ranks
        with the spawner's variables, stopped all when one fails (its exit code is the world's)."""
        from plait.runtime.env import STORE_ENV
        from plait.runtime.launch import STORE_NAME, free_port, rank_env

        logs = self._logs()
        port, faults = free_port(), str(logs / "faults")  # removed with the pool's directory
        os.mkdir(faults)
        pids = []
        for rank in range(nproc):
            rank_vars = {**rank_env(rank, nproc, port), **env, "PLAIT_FAULT_DIR": faults, "PLAIT_RESTART": "0",
                         STORE_ENV: os.path.join(faults, STORE_NAME)}
            pids.append(self.ask({"command": [sys.executable, script, *args], "env": rank_vars, "cwd": str(ROOT),
                                  "log": str(logs / f"rank{rank}")})["pid"])
        return self._finish([script, *args], pids, logs, [f"rank{r}" for r in range(nproc)], timeout)

    def run_cli(self, args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """`python -m plait ARGS` forked from the pool; its spawner forks its ranks from it
        (tests/zygote.WarmPopen)."""
        logs = self._logs()
        command = [sys.executable, "-m", "plait", *args]
        pid = self.ask({"command": command, "env": env, "cwd": str(cwd), "log": str(logs / "plait")})["pid"]
        return self._finish(command, [pid], logs, ["plait"], timeout)

    def _logs(self) -> Path:
        with self.lock:
            self.runs += 1
            logs = self.dir / f"run{self.runs}"
        logs.mkdir()
        return logs

    def _finish(self, args: list[str], pids: list[int], logs: Path, names: list[str],
                timeout: float) -> subprocess.CompletedProcess:
        """Wait for `pids`; their exit code and output as subprocess.run(capture_output=True,
        text=True) gives them, or its TimeoutExpired."""
        code = self._wait(pids, time.time() + timeout)
        stdout = "".join((logs / f"{name}.stdout").read_text() for name in names)
        stderr = "".join((logs / f"{name}.stderr").read_text() for name in names)
        if code is None:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(args, code, stdout, stderr)

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
        """Stop the zygote and remove its directory (socket, logs, the worlds' fault notes)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_losses(out: Path) -> list[float]:
    """Every step's loss of the `plait train` run in `out` (its metrics.jsonl)."""
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_weights(out: Path) -> dict[str, list[float]]:
    """The final weights the `plait train` run in `out` wrote, flattened by name."""
    from safetensors.torch import load_file

    return {k: v.flatten().tolist() for k, v in load_file(out / "model.safetensors").items()}


def save_report(report: dict[str, Any]) -> None:
    """Called inside a world script: write this rank's findings for the test to read."""
    path = Path(os.environ["PLAIT_TEST_OUT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(report))


def run_plait(*args: str, timeout: float = 300, cwd: Path | None = None,
              env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the `plait` CLI as a user would (python -m plait ...), forked from the session's pool
    with its ranks (tests/zygote.py): the command's own code, spawner included, runs as it
    would from a shell, without an `import torch` per process."""
    starting_processes(f"plait {' '.join(args[:1])}")
    env = _cli_env(env_extra)
    pool = Pool.serving(env)
    if pool is not None:
        return pool.run_cli(list(args), env, cwd or ROOT, timeout)
    return run_plait_fresh(*args, timeout=timeout, cwd=cwd, env_extra=env_extra)


def run_plait_fresh(*args: str, timeout: float = 300, cwd: Path | None = None,
                    env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """run_plait in new interpreters (the command and each rank exec'd): run_plait's fallback
    when the pool is off (PLAIT_TEST_POOL=0) or cannot start, and the runs that must cross
    the exec boundary (a slow killed-rank restart and elastic resizes, whose bytes are held
    against pooled references)."""
    starting_processes(f"plait {' '.join(args[:1])}")
    return subprocess.run([sys.executable, "-m", "plait", *args], env=_cli_env(env_extra), cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _cli_env(env_extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of a command typed in a shell: none of a launcher's rank variables."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_SPAWNED"):
        env.pop(name, None)
    return env


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

    def computed(self) -> list[Any]:
        """The keys run so far, in the order they ran."""
        return list(self._done)

    def __getitem__(self, key: Any) -> Any:
        if key not in self._done:
            self._done[key] = self._make(key)
        return self._done[key]
