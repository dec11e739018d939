"""Restarts: `--resume auto`, the command a restarted world runs, and how many came before.

Torch-free: the spawner and the CLI use it before any rank starts. A restarted world resumes
from the run's `latest` checkpoint; resume is exact (docs/checkpoints.md), so a run that lost
a rank and restarted ends with the same weights, to the bit, as one that never failed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from plait.errors import PlaitError

AUTO = "auto"
# The launchers' own counters: plait's spawner, torchrun (elastic agent), Slurm (--requeue).
RESTART_VARIABLES = ("PLAIT_RESTART", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def has_checkpoint(out: str) -> bool:
    """Whether the run writing to `out` has a finished checkpoint to resume from."""
    return (Path(out) / "checkpoints" / "latest" / "index.json").exists()


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, a `checkpoints/` folder, or a run's --out: its latest checkpoint."""
    path = Path(path)
    for candidate in (path, path / "latest", path / "checkpoints" / "latest"):
        if (candidate / "index.json").exists():
            return candidate.resolve()
    if not path.exists():
        raise PlaitError(f"checkpoint {path} does not exist", hint="give a step-N directory or a run's --out")
    if path.name.startswith("step-") or path.name.startswith(".tmp-step-"):
        raise PlaitError(f"checkpoint {path} is incomplete: {path / 'index.json'} is missing",
                         hint="it was probably interrupted while saving; use the run's latest checkpoint")
    raise PlaitError(f"no checkpoint found in {path}", hint="give a step-N directory or a run's --out")


# What every index.json holds, and the type of each (plait.train.checkpoint.write writes them).
INDEX_FIELDS = {"format": str, "step": int, "world_size": int, "files": dict, "tensors": dict}


def read_index(path: Path) -> dict[str, Any]:
    """A checkpoint directory's index.json, or one error saying it is damaged (not JSON, not
    UTF-8, or without the fields every index holds)."""
    file = path / "index.json"
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlaitError(f"checkpoint index {file} cannot be read: {exc.strerror or exc}",
                         hint="check the file's permissions and the file system") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise PlaitError(f"checkpoint index {file} is damaged: {exc}", hint="use an older checkpoint") from None
    wrong = [name for name, kind in INDEX_FIELDS.items() if not isinstance(index, dict)
             or not isinstance(index.get(name), kind)]
    problem = f"it has no valid {', '.join(wrong)}" if wrong else _entry_problem(index)
    if problem:
        raise PlaitError(f"checkpoint index {file} is damaged: {problem}", hint="use an older checkpoint")
    return index


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _whole_list(value: Any) -> bool:
    return isinstance(value, list) and all(_whole(v) for v in value)


def _entry_problem(index: dict[str, Any]) -> str | None:
    """What is wrong inside a checkpoint index's files and tensors (None: nothing): each file
    its size and hash, each tensor its shape, dtype and pieces, each piece in a listed file."""
    for name, info in index["files"].items():
        if not (isinstance(info, dict) and _whole(info.get("bytes")) and isinstance(info.get("sha256"), str)):
            return f"file {name} has no valid size and sha256"
    for field in ("layout", "trainer"):
        if not isinstance(index.get(field, {}), dict):
            return f"its {field} is not a table"
    for name, entry in index["tensors"].items():
        if not (isinstance(entry, dict) and _whole_list(entry.get("shape")) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("pieces"), list)):
            return f"tensor {name} has no valid shape, dtype and pieces"
        for piece in entry["pieces"]:
            if not (isinstance(piece, dict) and piece.get("file") in index["files"]
                    and isinstance(piece.get("key"), str) and _whole_list(piece.get("offsets"))
                    and _whole_list(piece.get("lengths"))
                    and len(piece["offsets"]) == len(piece["lengths"]) == len(entry["shape"])):
                return f"a piece of tensor {name} is not a block of it in one of its files"
    return None


def resolve_auto(config):  # TrainConfig -> TrainConfig (no import: config.py imports this module)
    """`--resume auto`: the run's own latest checkpoint if there is one, else a fresh start."""
    if config.resume != AUTO:
        return config
    return replace(config, resume=config.out if has_checkpoint(config.out) else "")


def restart_argv(argv: list[str], out: str, nproc: int | None = None, grad_accum: int | None = None) -> list[str]:
    """What a restarted world runs: the same flags, resuming from the latest checkpoint if any
    (without one, the same command again: a --resume the user gave still applies). A world of
    another size gets its --nproc and the --grad-accum that keeps the global batch (the last
    flag given wins), so that even a run with nothing saved yet trains the same batches."""
    resized = ["--nproc", str(nproc), "--grad-accum", str(grad_accum)] if nproc is not None else []
    return [*argv, *resized, *(["--resume", AUTO] if has_checkpoint(out) else [])]


def restart_count() -> int:
    """How many times the launcher restarted this job before this world (0: first try)."""
    for name in RESTART_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def warn_restarts_without_saves(max_restarts: int, save_every: int) -> None:
    """Said at the start, not discovered after a failure."""
    if max_restarts > 0 and save_every == 0:
        print(f"plait: warning: --max-restarts {max_restarts} without --save-every: nothing is saved, "
              "so a restart would lose everything and train from step 0 again", file=sys.stderr, flush=True)
