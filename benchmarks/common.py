"""What every benchmark shares: its own section of RESULTS.md, and the machine line."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, text: str) -> None:
    """Replace benchmark `name`'s section of RESULTS.md (between its markers), or append it;
    the other benchmarks' sections are left as they are."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    current = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"{start}\n{text}\n{end}"
    if start in current:
        head, rest = current.split(start, 1)
        current = head + section + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(current)


def torch_version() -> str:
    import torch

    return torch.__version__


def machine() -> str:
    """'2-core CPU (x86_64), torch 2.13.0+cpu': where the numbers were taken."""
    return f"{os.cpu_count()}-core CPU ({platform.machine()}), torch {torch_version()}"


def run_world(script: str, nproc: int, args: list[str], env: dict[str, str] | None = None) -> dict:
    """Run `script --worker --result FILE ARGS` on `nproc` ranks with `plait launch`; return
    what its rank 0 wrote to FILE."""
    import json
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "plait", "launch", "--nproc", str(nproc), script, "--worker",
               "--result", str(result), *args]
        subprocess.run(cmd, check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root), **(env or {})})
        return json.loads(result.read_text())


def train_summary(flags: list[str], env: dict[str, str] | None = None) -> dict:
    """One `plait train FLAGS` run, as a user types it, in a scratch --out; its summary.json.
    A failing run raises with the end of its output."""
    import json
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "plait", "train", *flags, "--out", out], cwd=root,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root), **(env or {})})
        if proc.returncode:
            raise RuntimeError(f"plait train {' '.join(flags)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads((Path(out) / "summary.json").read_text())


def timed_on_all_ranks(world, action) -> float:
    """Seconds `action` takes on the slowest rank: a barrier before, a barrier after."""
    from plait.runtime import comm

    comm.barrier(world)
    start = time.perf_counter()
    action()
    comm.barrier(world)
    return time.perf_counter() - start


def time_calls(owner: object, name: str, add: Callable[[float], None]) -> None:
    """Replace `owner.name` (a function of a module or class) by one that passes the seconds
    each call took to `add`: a benchmark's own clock, nothing changed for training."""
    original = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    setattr(owner, name, timed)


def disk_usage(path: Path) -> int:
    """Bytes of the files below `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, with the flags every benchmark has."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def publish(name: str, text: str, args: argparse.Namespace) -> None:
    """Print a benchmark's table, and put it in RESULTS.md as section `name` unless --no-write."""
    print(text)
    if not args.no_write:
        write_section(name, text)


def finish(name: str, args: argparse.Namespace, worker, drive, table) -> None:
    """Inside a world, run `worker`; outside, spawn the worlds (`drive`), print the table and
    put it in RESULTS.md unless --no-write."""
    if args.worker:
        worker(args)
        return
    publish(name, table(drive(args), args), args)
