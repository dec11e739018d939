"""A crowded host's pipeline pace, measured by `plait calibrate` (CPU only): how much faster a
rank trains while the schedule leaves the others asleep (`measure_lone_speedup`), and how much
longer ZB-H1's split backward takes than a whole one (`measure_split_backward`), each on
`one_block` at the model's widths and every micro-batch (estimate/pipeline.Crowd,
estimate/ops.micro_batch_compute_s).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from plait.bench import timing
from plait.bench.calibrate import dtype_of
from plait.models.gpt.config import GPTConfig
from plait.runtime.mesh import Mesh


CROWDING_BURST_S = 0.15  # a burst of the block's steps, every rank at work: wake-ups a few ms of it
CROWDING_ROUNDS = 9  # five measured 1.92-2.23 on 4 ranks on 2 cores


def measure_lone_speedup(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int) -> float:
    """On a crowded host, how much faster a rank trains while only as many ranks as the
    cores hold work, the others asleep in a barrier, than while every rank works: a block at
    the model's widths (one layer, a small vocabulary), forward and backward at `micro_batch`,
    in bursts taken both ways in turns, each timed from the first rank's start to the last
    working rank's end. Shared without loss that is `crowding` (2 for 4 one-thread ranks on 2
    cores); ranks that share cores also share caches, and a block's steps measured 1.99-2.22
    here (micro-batches 16 to 1), not 2. 0.0 where the host is not timing.crowded. A pipeline's
    waiting ranks give the working ones this pace (estimate/pipeline.Crowd)."""
    if not timing.crowded(mesh):
        return 0.0
    from plait.models.gpt.model import build_gpt

    block = one_block(config, seq_len)
    model = build_gpt(block, 0).to(mesh.device)
    ids = torch.randint(0, block.vocab_size, (micro_batch, seq_len), device=mesh.device)

    def train() -> None:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()

    train()
    burst = max(1, math.ceil(CROWDING_BURST_S / max(timing.slowest(mesh, [timing.median_s(train, 2)])[0], 1e-6)))
    working = max(1, int(mesh.env.world_size / timing.crowding(mesh)))  # one thread a core
    spans: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(CROWDING_ROUNDS):
        for everyone in (True, False):
            timing.in_step(mesh)
            works = everyone or mesh.env.rank < working
            start = time.monotonic() if works else math.inf
            for _ in range(burst if works else 0):
                train()
            end = time.monotonic() if works else -math.inf
            spans[everyone].append(timing.round_spans(mesh, [[start]], [[end]])[0][0])
    return max(1.0, statistics.median(spans[True]) / statistics.median(spans[False]))


def one_block(config: GPTConfig, seq_len: int) -> GPTConfig:
    """The block a calibration trains to time a rank's pace: one layer at `config`'s widths, a
    vocabulary of 256 (the head a block's share, not the model's), untied (ZB-H1's split needs
    each weight in one module)."""
    return GPTConfig(vocab_size=256, n_layers=1, d_model=config.d_model, n_heads=config.n_heads,
                     n_kv_heads=config.n_kv_heads, ffn_hidden=config.ffn_hidden, max_seq_len=seq_len,
                     tie_embeddings=False)


SPLIT_ROUNDS = 9  # as CROWDING_ROUNDS: each round a whole and a split micro-batch, 0.1-0.4 s on `small`


def measure_split_backward(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int,
                           precision: str = "fp32") -> float:
    """How much longer a micro-batch takes with its backward split in I and W, as ZB-H1 runs it
    (plait.parallel.pipeline.execute.StageWork), than whole: `one_block` in `precision`'s dtype,
    forward and backward both ways in turns, every rank at once, set against each other as the
    GEMMs are (`median_rounds`, watched), the slowest rank's. On `small`, 1.03-1.13 at
    micro-batches 16 to 1 on 4 ranks sharing 2 cores (benchmarks/RESULTS.md, run 14), where what
    W makes again priced 1.02 (estimate/ops.micro_batch_compute_s reads it). Measured at the
    calibration's sequence and tp 1: a layout's micro-batch reads the nearest micro-batch's."""
    from plait.models.gpt.model import build_gpt
    from plait.parallel.pipeline.execute import StageWork

    block = one_block(config, seq_len)
    ids = torch.randint(0, block.vocab_size, (micro_batch, seq_len), device=mesh.device)
    dtype = dtype_of(precision)  # fp8's blocks run bf16 outside their products

    def train(split: bool) -> Callable[[], None]:
        work = StageWork(build_gpt(block, 0).to(mesh.device, dtype), split_backward=split)

        def step() -> None:
            out, state = work.forward(ids, grad_input=False)
            loss = F.cross_entropy(out.flatten(0, 1).float(), ids.flatten())
            if split:  # as the runner hands I the last stage's loss
                state.output, state.loss_input = loss, out
                work.backward_input(state, None)
                work.backward_weight(state)
            else:
                loss.backward()
            work.module.zero_grad(set_to_none=True)
            timing.device_sync(mesh)
        return step

    whole, split = timing.slowest(mesh, timing.median_rounds(mesh, [train(False), train(True)], SPLIT_ROUNDS, watched=True))
    return split / whole
