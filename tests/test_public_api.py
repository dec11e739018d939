"""The public names code outside plait relies on, and that `import plait` stays light."""

from __future__ import annotations

import subprocess
import sys

import plait


def test_public_names_resolve():
    for name in ("init_mesh", "Mesh", "Layout", "ParallelConfig", "parallelize", "build_optimizer",
                 "clip_grad_norm", "no_sync", "shard_indices", "apply_pipeline", "PipelineRunner",
                 "full_parameters", "PlaitError"):
        assert getattr(plait, name) is not None, name


def test_import_plait_and_help_do_not_import_torch():
    code = "import sys, plait, plait.cli; assert 'torch' not in sys.modules, 'torch was imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
