"""`plait calibrate --nproc N` refuses, before spawning, more ranks than this machine runs
(one per GPU where there are GPUs): two NCCL ranks on one GPU failed with "invalid usage"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_calibrate_refuses_more_ranks_than_the_machine_runs(tmp_path: Path) -> None:
    from plait.runtime.launch import max_local_processes

    too_many = max_local_processes() + 1
    proc = subprocess.run([sys.executable, "-m", "plait", "calibrate", "--nproc", str(too_many), "--out",
                           str(tmp_path / "hw.toml")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--nproc {too_many} is more than this machine allows" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "hw.toml").exists()
