"""The demo's first 20 losses, as committed in tests/golden/demo.json (see tests/golden.py).

`make demo` trains 120 steps; its learning-rate schedule depends on that length, so this
runs the demo exactly (its embedded defaults) and stops it as step 21 begins, with plait's
own fault injection (PLAIT_INJECT, plait/runtime/inject.py): metrics.jsonl then holds the
first 20 steps. About 20 s of the demo's training: `make test-all`.
"""

from __future__ import annotations

import json

import pytest

from tests.golden import check
from tests.worldlib import run_plait


@pytest.mark.slow
def test_the_demo_keeps_its_first_20_losses(tmp_path):
    proc = run_plait("train", "--out", str(tmp_path), env_extra={"PLAIT_INJECT": "0:0:21:KILL"}, timeout=600)
    assert "rank 0 sends itself SIGKILL at step 21" in proc.stderr, proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))
    check("demo", [r["loss"] for r in lines], "plait train (the demo's defaults), first 20 steps")
