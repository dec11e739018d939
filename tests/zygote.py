"""Ranks without `import torch`: a process that imports torch and plait once, then forks a
rank for each request (tests/worldlib.run_world's pool).

A world costs seconds before its first collective, almost all of it each rank importing
torch (about 3 s here, two ranks sharing two cores). Forked from this process, a rank starts
with torch and plait already imported and nothing else done: no tensor op has run here, so
no thread pool exists to be broken by the fork, no process group, no CUDA context (a fork
after CUDA starts is refused). Each rank is its own forked process with the environment its
request names, so a failing or hanging case cannot poison the next: every case starts from
this same untouched parent.

The same pool runs the `plait` command itself (tests/worldlib.run_plait): the forked process
is `python -m plait ARGS`, and the ranks its spawner starts are forked from it in turn
(WarmPopen) instead of exec'ing a new interpreter. The spawner's own code (watching the
ranks, naming failures, restarting, forwarding signals) runs unchanged; only the 3-4 s
import per rank is gone. Before the spawner forks, the parent has run no tensor op either
(plait's command line loads torch only in ranks). One difference from exec remains: forked
processes share the parent's string-hash seed, so an order that follows a set of strings is
the same on every rank here, where real ranks could disagree; the launcher tests, the
whole-job signal tests and the slow tier's killed-rank restart and elastic resizes exec real
processes and would see that.

Protocol (one JSON line each way over a Unix socket, one request at a time):
    {"command": [python, script.py | "-m", "plait", ...], "env": {...}, "cwd": dir, "log": prefix}
                                                                          -> {"pid": n}
    {"poll": pid}                                                         -> {"code": int | null}
The process's stdout and stderr go to `prefix`.stdout and `prefix`.stderr; its exit code is
the script's, 1 for an uncaught exception (printed as Python prints it). The client signals
processes itself (`os.killpg`: each leads its own process group, its ranks in it) and polls
here, the parent, for their exit.

    python -m tests.zygote SOCKET     (tests/worldlib.py starts it, once per test session)
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import traceback
from typing import Any

# torch._dynamo too: building any torch optimizer imports it (Optimizer.__init__ is wrapped by
# torch._disable_dynamo), 1.4 s of each rank's start that the pool pays once instead. And
# Inductor's compile_fx, which each rank of a --compile world imported at its first compile
# (1.2 s of CPU a rank here, in 22 ranks of the compiled rows and their later runs); importing
# it starts no thread or process.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "numpy", "plait.train.loop.trainer",
           "plait.runtime.mesh", "plait.families")
# transformers' model code when it is installed: 1.7 s of each rank that loads an `hf:` model.
PRELOAD_IF_INSTALLED = ("transformers.modeling_utils",)
OPEN: list[socket.socket] = []  # the parent's sockets, which a rank closes first


def main() -> None:
    path = sys.argv[1]
    for name in PRELOAD:
        __import__(name)
    for name in PRELOAD_IF_INSTALLED:
        with contextlib.suppress(ImportError):
            __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client waits for this name: it appears once we listen
    server.listen(8)
    OPEN.append(server)
    while True:
        conn, _ = server.accept()
        OPEN.append(conn)
        with conn, conn.makefile("rw") as stream:
            for line in stream:
                request = json.loads(line)
                stream.write(json.dumps(_answer(request)) + "\n")
                stream.flush()
        OPEN.remove(conn)


def _answer(request: dict) -> dict:
    if "poll" in request:
        pid, status = os.waitpid(request["poll"], os.WNOHANG)
        return {"code": None if pid == 0 else os.waitstatus_to_exitcode(status)}
    pid = os.fork()
    if pid == 0:
        try:
            _rank(request)  # never returns
        finally:
            os._exit(1)  # reached only when the child failed before running anything
    return {"pid": pid}


def _rank(request: dict) -> None:
    """The forked child: become the process the request describes, run it, exit."""
    for sock in OPEN:  # the fds themselves: the parent's stream objects still refer to them
        os.close(sock.fileno())
    os.setpgid(0, 0)
    out = os.open(request["log"] + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["log"] + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.chdir(request["cwd"])
    main = _python_main(request["command"])
    if main is None:
        raise ValueError(f"the pool runs `python -m plait ...` or `python script.py ...`, not {request['command']}")
    subprocess.Popen = WarmPopen  # a spawner here forks its ranks from this process
    _run_main(request["env"], *main)


def _run_main(env: dict[str, str], path0: str, run: Any, argv0: str, argv: list[str]) -> None:
    """Run `run` as a new interpreter's __main__ would with `env`, `argv` and sys.path[0] =
    `path0`; exit with its code (never returns)."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [argv0, *argv]
        sys.path[0] = path0
        sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        run()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a rank's crash is its report
        traceback.print_exc()
    finally:
        _exit(code)


class WarmPopen(subprocess.Popen):
    """subprocess.Popen whose `python -m plait ...` and `python script.py ...` children are
    forked from this process (torch imported, nothing run) rather than exec'd; any other
    command starts as usual.

    The child is what exec would give: default signal handlers (the spawner's forwarding
    handler is not inherited), the environment and arguments asked for, stdout and stderr
    shared with the parent. Python's own Popen machinery (poll, wait, kill, send_signal)
    works on it unchanged, since it is a plain child process."""

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                       cwd: Any, env: Any, *rest: Any) -> None:
        pipes = rest[3:9]  # p2cread ... errwrite: -1 when stdin/out/err are inherited
        plain = list(pipes) == [-1] * 6 and preexec_fn is None and cwd is None and env is not None
        main = _python_main(list(args)) if plain else None
        if main is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)
        sys.stdout.flush()  # else the child would write the parent's unflushed lines again
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            env = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                   for k, v in env.items()}
            _run_main(env, *main)
        self.pid = pid
        self._child_created = True


def _python_main(args: list[str]) -> tuple[str, Any, str, list[str]] | None:
    """(sys.path[0], how to run it, argv[0], the rest) for `python -m plait ...` and
    `python script.py ...`, the two commands plait's spawner starts (and the pool's own
    requests); None for anything else."""
    if len(args) >= 3 and args[:3] == [sys.executable, "-m", "plait"]:
        return os.getcwd(), lambda: runpy.run_module("plait", run_name="__main__", alter_sys=True), "", args[3:]
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py") and os.path.isfile(args[1]):
        script = os.path.abspath(args[1])
        return os.path.dirname(script), lambda: runpy.run_path(script, run_name="__main__"), args[1], args[2:]
    return None


def _exit(code: int) -> None:
    """Exit as an interpreter would (atexit handlers, flushed streams), then leave for good."""
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
