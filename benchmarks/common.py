"""What every benchmark shares: its own section of RESULTS.md, and the machine line."""

from __future__ import annotations

import os
import platform
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
