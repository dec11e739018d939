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


def test_a_layout_field_given_to_parallel_config_says_where_it_goes_now():
    """Code written for the earlier API (ParallelConfig(zero=3)) gets one PlaitError naming the
    field and init_mesh, not a bare TypeError; the hint's call works; the rest is unchanged."""
    import dataclasses

    import pytest

    with pytest.raises(plait.PlaitError) as caught:
        plait.ParallelConfig(zero=3, bucket_mb=10)
    assert caught.value.message == "ParallelConfig(zero=3): zero is a layout field, carried by the mesh"
    assert caught.value.hint.startswith("pass it to plait.init_mesh(zero=3) (or in the plait.Layout(...)")
    assert "bucket_mb, recompute" in caught.value.hint
    with pytest.raises(plait.PlaitError, match=r"zero and tp are layout fields.*init_mesh\(zero=3, tp=2\)"):
        plait.ParallelConfig(zero=3, tp=2)
    assert plait.init_mesh(zero=3).layout.zero == 3  # where the hint sends it (one process: no group)
    config = plait.ParallelConfig(10.0, recompute="full")
    assert (config.bucket_mb, config.recompute) == (10.0, "full")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_mb = 5.0  # type: ignore[misc]
    assert dataclasses.replace(config, sync_bn=True).sync_bn
    with pytest.raises(TypeError):  # a name that is no field anywhere is still Python's error
        plait.ParallelConfig(buckets=3)
