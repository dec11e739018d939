"""Suite-wide settings for the processes the tests start."""

import os
import sys

# Bytecode is kept (in each folder's __pycache__, which git ignores) even where the environment
# sets PYTHONDONTWRITEBYTECODE: without it every process of the suite compiles plait, and every
# pytest process rewrites and compiles every test module, from source again. Measured on the
# 2-core machine (2026-12-04): collecting the whole suite took 12.8-14.6 s without bytecode and
# 8.7-9.7 s with it; importing plait's trainer and command line 2.6-3.0 s a process against
# 2.3 s. The ranks, commands and paired pytest the suite starts inherit the setting.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# `plait train` calibrates the machine for its closing time prediction the first time it
# meets a new shape; the suite's many short runs do not read that prediction, so they use
# the device's preset. tests/test_time_model.py calibrates explicitly.
os.environ.setdefault("PLAIT_CALIBRATION", "off")

# Every `plait train` draws its plots at the end (about 1.5 s of CPU); the suite's many runs
# skip them, and tests/test_report.py turns them back on for the runs it inspects.
os.environ.setdefault("PLAIT_REPORT", "off")


import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

# One compile cache for every test that compiles: in this process, the paired one
# (tests/pairing.py) and the worlds. A new cache folder costs Inductor about 14 s before its
# first kernel (probing the CPU's vector ISAs, building its precompiled header), and the
# compiled rows, the compiled census and selective recompute under compile had used three.
# It is kept between runs, as Inductor's own default folder is: a later run of the suite on
# the same machine loads the kernels it compiled (the compiled files took 298 s in a new
# folder, 140 s in a used one, from the same .venv: a kernel's key holds its compile command,
# the .venv's include paths among them).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"plait-tests-inductor-{os.getuid()}")


def _gpus() -> int:
    """NVIDIA GPUs on this machine, counted without torch (nothing may touch CUDA before the
    variable below is set)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# The suite's worlds run up to 8 ranks, and NCCL puts one rank on one GPU. On a machine with
# fewer GPUs than that (one, typically) every test process runs on the CPU with Gloo, as CI
# does, and the CPU facts some tests assert (the `cpu` preset, a C++ compiler for --compile)
# hold; the GPU paths are benchmarks/gpu.py's (`--parts correct`). PLAIT_TEST_GPU=1 keeps the GPUs.
GPUS = _gpus()
if 0 < GPUS < 8 and os.environ.get("PLAIT_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


import pytest  # noqa: E402

# The MoE worlds' fixtures, shared by two test files and computed once per session; the
# one-process files run two at a time (tests/pairing.py).
pytest_plugins = ["tests.pairing", "tests.moe_fixtures", "tests.matrix"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the worlds' pool (tests/worldlib.Pool) now when the run is the suite or a folder of
    it: its zygote's `import torch` (about 5 s) then takes the core that collection leaves idle,
    where started by the first world it held that world up. Not with the pool off."""
    args = session.config.args
    if os.environ.get("PLAIT_TEST_POOL", "1") != "0" and args and all(os.path.isdir(arg) for arg in args):
        from tests.worldlib import Pool

        Pool.get()


def pytest_report_header(config: pytest.Config) -> str | None:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" and GPUS:
        return (f"plait: {GPUS} GPU(s), fewer than the suite's 8-rank worlds: every test runs on the CPU with Gloo "
                "(benchmarks/gpu.py checks the GPU paths; PLAIT_TEST_GPU=1 keeps the GPUs)")
    return None
