"""Committed loss curves: a commit that changes what plait computes changes them, and fails.

`check(name, losses)` compares a run's losses with tests/golden/NAME.json (rtol 1e-5, the
parity tolerance: a change of initialisation, data order or arithmetic moves them by far
more). When the change is meant, rewrite the files and commit them with it:

    PLAIT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_cli.py -k golden      # the tiny run
    PLAIT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -m slow tests/test_golden.py     # the demo
    PLAIT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -m slow tests/test_examples.py   # the transformers example
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.parity import assert_losses_close

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = "PLAIT_UPDATE_GOLDEN"


def check(name: str, losses: list[float], command: str) -> None:
    """Hold `losses` to the committed curve `name` (or write it, under PLAIT_UPDATE_GOLDEN=1)."""
    path = GOLDEN / f"{name}.json"
    if os.environ.get(UPDATE) == "1":
        path.write_text(json.dumps({"command": command, "losses": losses}, indent=1) + "\n")
        return
    if not path.exists():
        pytest.fail(f"{path} is missing: run with {UPDATE}=1 to write it")
    golden = json.loads(path.read_text())
    assert golden["command"] == command, f"{path} was made by another command: update it ({UPDATE}=1)"
    assert_losses_close(losses, golden["losses"])
