"""`plait plan` ranks layouts as this machine runs them: calibrate 2 ranks, plan `small`, train
the plan's first layouts, and hold the first pick to the fastest measured and every prediction
to its measurement. benchmarks/planner_measured.py does the same with repeats, for 2 and 4
ranks, and writes the table (benchmarks/RESULTS.md, "planner-measured"); this is one pass,
with bars wide enough for a busy minute of a shared 2-core machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.worldlib import ROOT, run_plait

pytestmark = pytest.mark.slow  # a calibration and three trainings: ~1.5 min here


def _bench():
    spec = importlib.util.spec_from_file_location("planner_measured", ROOT / "benchmarks" / "planner_measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plans_first_pick_measures_near_the_fastest_of_its_top_three(tmp_path: Path) -> None:
    bench = _bench()
    hw = tmp_path / "hw.toml"
    proc = run_plait("calibrate", "--nproc", "2", "--model", "small", "--micro-batch", "8", "--seq-len", "128",
                     "--tp", "1,2", "--cp", "1,2", "--quick", "--out", str(hw), "--no-cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_plait("plan", "--model", "small", "--gpus", "2", "--global-batch", "16", "--seq-len", "128",
                     "--hardware-file", str(hw), "--gpus-per-node", "2", "--top", "3", "--precision", "fp32", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    rows = found["layouts"] if isinstance(found, dict) else found
    measured = []
    for i, row in enumerate(rows):
        out = tmp_path / f"run{i}"
        proc = run_plait("train", "--model", "small", "--seq-len", "128", "--steps", "6", "--eval-every", "0",
                         "--precision", "fp32", "--eval-samples", "16", "--sample-tokens", "0", "--no-report",
                         "--hardware-file", str(hw), "--nproc", "2", "--out", str(out), *bench.train_flags(row))
        assert proc.returncode == 0, proc.stderr[-2000:]
        measured.append(json.loads((out / "summary.json").read_text())["step_time"]["measured"]["step"])
    assert measured[0] <= 1.10 * min(measured), (rows, measured)
    for row, step in zip(rows, measured):
        assert abs(row["step_s"] / step - 1) <= 0.35, (row, step)
