"""tests/pairing.py: the one-process files run two at a time and report as one run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worldlib import ROOT, run_world

MARKED = '''import os, time
import pytest
pytestmark = pytest.mark.one_process

def test_{name}():
    time.sleep(1.0)  # long enough that the second process, once started, claims a file
    with open(os.path.join(os.environ["PAIR_PIDS"], "{name}"), "w") as out:
        out.write(str(os.getpid()))
    assert "{name}" != "bad", "planted"
'''


@pytest.mark.one_process
def test_a_marked_test_that_starts_a_world_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="is marked one_process .* but starts the world gloo_world.py"):
        run_world("gloo_world.py", 2, tmp_path)


def test_marked_files_run_in_two_processes_and_report_as_one(tmp_path: Path) -> None:
    """Three marked files and an unmarked one: both processes run marked files, the failure
    planted in one of them fails the run, and every test is counted once."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["tests.pairing"]\n')
    for name in ("first", "second", "bad"):
        (suite / f"test_{name}.py").write_text(MARKED.format(name=name))
    (suite / "test_plain.py").write_text("def test_plain():\n    pass\n")
    (tmp_path / "pids").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PLAIT_TEST_PAIR": "1", "PAIR_PIDS": str(tmp_path / "pids")}
    env.pop("PLAIT_TEST_PAIR_CHILD", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 3 passed" in proc.stdout, proc.stdout
    assert "AssertionError: planted" in proc.stdout
    pids = {path.name: path.read_text() for path in (tmp_path / "pids").iterdir()}
    assert set(pids) == {"first", "second", "bad"} and len(set(pids.values())) == 2, pids
