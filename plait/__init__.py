"""plait: train PyTorch models across many processes, and know what it costs.

    import plait
    mesh = plait.init_mesh(dp=2, zero=1)          # the layout (plait.Layout), checked once
    model = plait.parallelize(my_model, mesh)     # + plait.ParallelConfig(recompute=...)
    opt = plait.build_optimizer(model, torch.optim.AdamW, lr=3e-4)

Names are loaded lazily so that `plait --help` and the local spawner start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "init_mesh": "plait.runtime.mesh",
    "Mesh": "plait.runtime.mesh",
    "Layout": "plait.layout",
    "ParallelConfig": "plait.parallel.compose",
    "parallelize": "plait.api",
    "build_optimizer": "plait.parallel.compose",
    "clip_grad_norm": "plait.parallel.compose",
    "apply_pipeline": "plait.api",
    "PipelineRunner": "plait.parallel.pipeline.runner",
    "full_parameters": "plait.parallel.zero.stages",
    "no_sync": "plait.parallel.data.sync",
    "context_engaged": "plait.parallel.context.plan",
    "shard_batch": "plait.parallel.context.plan",
    "SyncBatchNorm": "plait.parallel.data.syncbn",
    "convert_sync_batchnorm": "plait.parallel.data.syncbn",
    "shard_indices": "plait.train.data.corpus",
    "PlaitError": "plait.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
