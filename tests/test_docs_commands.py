"""Every command in the tutorial runs, so the docs cannot rot.

The ```sh blocks of docs/tutorial/*.md are run as written, shortened by flags appended to
each `plait train` (argparse keeps the last value): 2 steps of the tiny model. Output
directories are redirected under pytest's tmp_path. The one-process page runs in the
default suite; the pages that spawn worlds run under `-m slow`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worldlib import run_plait

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial"
SHORT = ["--steps", "2", "--model", "tiny", "--seq-len", "32", "--eval-every", "0", "--sample-tokens", "0",
         "--no-report"]
FAST_PAGES = {"1-one-process.md"}


def sh_commands(page: Path) -> list[str]:
    """The commands of the page's ```sh blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def shortened(command: str, tmp: Path) -> list[str]:
    """The argv to run: plait and torchrun through this Python, outputs under `tmp`, trains short."""
    argv = shlex.split(command)
    program = {"plait": ["-m", "plait"], "torchrun": ["-m", "torch.distributed.run"]}
    assert argv[0] in program, f"the tutorial runs only plait and torchrun: {command}"
    args = argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith("runs/"):  # --out runs/x, plait report runs/x
            args[i] = str(tmp / arg)
    if "train" in args:  # a mixture of experts stays one (tiny-moe), the rest train tiny
        model = args[args.index("--model") + 1] if "--model" in args else ""
        args += [("tiny-moe" + model[model.index(","):] if "," in model else "tiny-moe")
                 if word == "tiny" and "moe" in model else word for word in SHORT]
    return [sys.executable, *program[argv[0]], *args]


def _pages() -> list:
    pages = sorted(TUTORIAL.glob("*.md"))
    return [pytest.param(p, marks=() if p.name in FAST_PAGES else pytest.mark.slow, id=p.name) for p in pages]


def test_the_tutorial_has_its_ladder() -> None:
    names = [p.name for p in sorted(TUTORIAL.glob("*.md"))]
    assert names == ["1-one-process.md", "2-data-parallel.md", "3-zero.md", "4-tensor.md", "5-pipeline.md",
                     "6-3d.md", "7-context.md", "8-experts.md"]
    for page in TUTORIAL.glob("*.md"):
        assert sh_commands(page), f"{page.name} has no ```sh commands"
        for image in re.findall(r"\]\((\.\./img/[^)]+)\)", page.read_text()):
            assert (TUTORIAL / image).is_file(), f"{page.name} shows a missing picture {image}"


@pytest.mark.parametrize("page", _pages())
def test_every_command_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "PLAIT_SPAWNED")}
    env["PYTHONPATH"] = str(ROOT)
    for command in sh_commands(page):
        argv = shortened(command, tmp_path)
        if argv[1:3] == ["-m", "plait"]:  # from the session's pool, as the other tests' commands
            proc = run_plait(*argv[3:], cwd=tmp_path, timeout=600)
        else:
            proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        if "train" in argv:
            out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else tmp_path / "runs/latest"
            steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert steps == [1, 2], command
