"""Save a checkpoint at step 1, then die by SIGKILL in the middle of saving step 2."""

import os
import signal
import sys
from pathlib import Path

import torch

from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.checkpoint import write as checkpoint

root = Path(sys.argv[1])
mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
model = build_gpt(get_preset("tiny"), 0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
opt.step()
checkpoint.save(root, 1, model, opt, mesh, {"note": "good"})


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # rank files are written; index and rename never happen


checkpoint._write_index = die
checkpoint.save(root, 2, model, opt, mesh, {"note": "never finished"})
