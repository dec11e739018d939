"""Ranks without `import torch`: a process that imports torch and plait once, then forks a
rank for each request (tests/worldlib.run_world's pool).

A world costs seconds before its first collective, almost all of it each rank importing
torch (about 3 s here, two ranks sharing two cores). Forked from this process, a rank starts
with torch and plait already imported and nothing else done: no tensor op has run here, so
no thread pool exists to be broken by the fork, no process group, no CUDA context (a fork
after CUDA starts is refused). Each rank is its own forked process with the environment its
request names, so a failing or hanging case cannot poison the next: every case starts from
this same untouched parent.

Protocol (one JSON line each way over a Unix socket, one request at a time):
    {"run": script, "argv": [...], "env": {...}, "cwd": dir, "log": prefix} -> {"pid": n}
    {"poll": pid}                                                         -> {"code": int | null}
The rank's stdout and stderr go to `prefix`.stdout and `prefix`.stderr; its exit code is
the script's, 1 for an uncaught exception (printed as Python prints it). The client signals
ranks itself (`os.killpg`: each rank leads its own process group) and polls here, the
parent, for their exit.

    python -m tests.zygote SOCKET     (tests/worldlib.py starts it, once per test session)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

PRELOAD = ("torch", "numpy", "plait.train.trainer", "plait.runtime.mesh", "plait.families")
OPEN: list[socket.socket] = []  # the parent's sockets, which a rank closes first


def main() -> None:
    path = sys.argv[1]
    for name in PRELOAD:
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
        _rank(request)  # never returns
    return {"pid": pid}


def _rank(request: dict) -> None:
    """The forked child: become the rank the request describes, run its script, exit."""
    code = 1
    try:
        for sock in OPEN:  # the fds themselves: the parent's stream objects still refer to them
            os.close(sock.fileno())
        os.setpgid(0, 0)
        out = os.open(request["log"] + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["log"] + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["run"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(script)  # as `python script` sets it
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a rank's crash is its report
        traceback.print_exc()
    finally:
        _exit(code)


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
