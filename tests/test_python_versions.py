"""The torch-free commands (`--help`, `estimate`, `plan`) on Python 3.10 and 3.12.

The full suite runs on the Python our torch build is for; these run the CLI under the other
interpreters pyenv provides, with the standard library alone (no tomli, no torch: a `torch`
that raises on import sits first on the path, so any import of it fails the test). Their
numbers must equal the ones this interpreter computes. A missing interpreter skips, saying
which; `make test-pythons` (run by .ci/run) sets PLAIT_REQUIRE_PYTHONS=1 so it fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from plait.cli import main as plait_main
from tests.worldlib import ROOT

ESTIMATE = ["--model", "llama-7b", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--seq-len", "4096",
            "--precision", "bf16", "--hardware", "h100-sxm", "--json"]
PLAN = ["--model", "llama-7b", "--gpus", "16", "--global-batch", "64", "--json"]


def interpreter(version: str) -> str | None:
    """python3.X from pyenv's versions (the newest patch release), else from PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(root.glob(f"versions/{version}.*/bin/python{version}"))
    return str(found[-1]) if found else shutil.which(f"python{version}")


@pytest.fixture(params=["3.10", "3.12"])
def python(request: pytest.FixtureRequest) -> str:
    path = interpreter(request.param)
    if path is None:
        reason = f"python{request.param} is not installed (pyenv install {request.param} to run this check)"
        if os.environ.get("PLAIT_REQUIRE_PYTHONS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def run(python: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m plait ARGS` with only the checkout and a poisoned `torch` on the path."""
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True, exist_ok=True)
    (poison / "__init__.py").write_text("raise ImportError('the torch-free path imported torch')\n")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{poison.parent}", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = subprocess.run([python, "-s", "-m", "plait", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_help_estimate_and_plan_run_without_torch(python: str, tmp_path: Path, capsys) -> None:
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout
    assert version.strip() in ("(3, 10)", "(3, 12)"), version
    assert "estimate" in run(python, tmp_path, "--help").stdout
    plait_main(["estimate", *ESTIMATE])
    assert json.loads(run(python, tmp_path, "estimate", *ESTIMATE).stdout) == json.loads(capsys.readouterr().out)
    plait_main(["plan", *PLAN])
    assert json.loads(run(python, tmp_path, "plan", *PLAN).stdout) == json.loads(capsys.readouterr().out)


def test_a_hardware_file_on_310_needs_tomli_or_says_so(tmp_path: Path) -> None:
    """Reading TOML is the one torch-free step that needs more than 3.10's standard library."""
    python = interpreter("3.10")
    if python is None:
        pytest.skip("python3.10 is not installed")
    has_tomli = subprocess.run([python, "-s", "-c", "import tomli"], capture_output=True).returncode == 0
    path = tmp_path / "hw.toml"
    path.write_text('[hardware]\nbase = "a100-40gb"\nname = "lab-a100"\n')
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = subprocess.run([python, "-s", "-m", "plait", "estimate", "--model", "tiny", "--hardware-file", str(path),
                           "--json"], env=env, capture_output=True, text=True, timeout=60)
    if has_tomli:
        assert proc.returncode == 0 and json.loads(proc.stdout)["layout"]["hardware"] == "lab-a100", proc.stderr
    else:
        assert proc.returncode == 2, proc.stderr
        assert "reading a --hardware-file on Python 3.10 needs the tomli package" in proc.stderr
        assert "hint: pip install tomli" in proc.stderr and "Traceback" not in proc.stderr
