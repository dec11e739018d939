"""The scripts in examples/ run as the README says, and train what they promise."""

from __future__ import annotations

import json
import re

import pytest

from tests.golden import GOLDEN, check
from tests.parity import assert_losses_close
from tests.worldlib import ROOT, run_plait


def _losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)$", stdout, flags=re.M)]


DDP_ONE = "plait launch --nproc 1 examples/ddp_user_model.py"


def test_a_user_model_under_ddp_trains_as_on_one_rank() -> None:
    """2 ranks against the one-rank curve committed in tests/golden/ddp_user_model.json."""
    two = run_plait("launch", "--nproc", "2", str(ROOT / "examples" / "ddp_user_model.py"))
    assert two.returncode == 0, two.stderr
    assert len(_losses(two.stdout)) == 6 and _losses(two.stdout)[-1] < _losses(two.stdout)[0] / 3
    golden = json.loads((GOLDEN / "ddp_user_model.json").read_text())
    assert golden["command"] == DDP_ONE
    assert_losses_close(_losses(two.stdout), golden["losses"], rtol=1e-5)
    assert "wire bytes per axis and op: {'dp': {'all_reduce': " in two.stdout


@pytest.mark.slow
def test_the_one_rank_curve_of_the_ddp_example_is_the_committed_one() -> None:
    proc = run_plait("launch", "--nproc", "1", str(ROOT / "examples" / "ddp_user_model.py"))
    assert proc.returncode == 0, proc.stderr
    check("ddp_user_model", _losses(proc.stdout), DDP_ONE)


HF_ONE = ["examples/hf_tp_pp.py", "--tp", "1", "--pp", "1"]


def test_a_transformers_model_under_tp_and_pp_trains_as_one_process() -> None:
    """4 ranks (tp 2 × pp 2) against the one-process curve committed in tests/golden/hf_tp_pp.json
    (rtol 1e-4: tp and pp change the summation order); `make test-all` makes that curve again."""
    proc = run_plait("launch", "--nproc", "4", str(ROOT / "examples" / "hf_tp_pp.py"))
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0]
    golden = json.loads((GOLDEN / "hf_tp_pp.json").read_text())
    assert golden["command"] == " ".join(["plait launch --nproc 1", *HF_ONE])
    assert_losses_close(losses, golden["losses"], rtol=1e-4)


@pytest.mark.slow
def test_the_one_process_curve_of_the_transformers_example_is_the_committed_one() -> None:
    proc = run_plait("launch", "--nproc", "1", *(str(ROOT / a) if a.endswith(".py") else a for a in HF_ONE))
    assert proc.returncode == 0, proc.stderr
    check("hf_tp_pp", _losses(proc.stdout), " ".join(["plait launch --nproc 1", *HF_ONE]))
