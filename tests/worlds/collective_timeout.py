"""Rank 1 never joins the all-reduce: rank 0 must fail after --timeout, naming rank, op and group."""

import os
import time

import torch

import plait
from plait.runtime import comm
from tests.worldlib import save_report

mesh = plait.init_mesh(timeout_s=2)
if mesh.rank("dp") == 1:
    time.sleep(4)  # alive, but not participating
    save_report({"slept": True})
else:
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), mesh.axis("dp"))
        save_report({"error": None})
    except comm.CommError as exc:
        save_report({"error": exc.message, "hint": exc.hint, "waited": time.monotonic() - start})
        # A group whose collective timed out cannot be torn down cleanly (Gloo may abort in
        # its destructor): leave without tearing it down, as plait's CLI does.
        os._exit(0)
