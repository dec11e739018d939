"""Rank 1 raises while rank 0 waits in a collective: the job must end, not hang."""

import torch

import plait
from plait.runtime import comm

mesh = plait.init_mesh(timeout_s=600)
if mesh.rank("dp") == 1:
    raise ValueError("boom on purpose")
comm.all_reduce(torch.ones(4), mesh.axis("dp"))  # never completes: rank 1 is gone
