"""The scripts in examples/ run as the README says, and train what they promise."""

from __future__ import annotations

import re
import sys

from tests.parity import assert_losses_close
from tests.worldlib import ROOT, run_plait


def _losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)$", stdout, flags=re.M)]


def test_a_user_model_under_ddp_trains_as_on_one_rank() -> None:
    script = str(ROOT / "examples" / "ddp_user_model.py")
    two, one = (run_plait("launch", "--nproc", n, script) for n in ("2", "1"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    assert len(_losses(two.stdout)) == 6 and _losses(two.stdout)[-1] < _losses(two.stdout)[0] / 3
    assert_losses_close(_losses(two.stdout), _losses(one.stdout), rtol=1e-5)
    assert "wire bytes per axis and op: {'dp': {'all_reduce': " in two.stdout
