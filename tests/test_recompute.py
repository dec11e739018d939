"""Activation recomputation: the same numbers, fewer saved bytes, clear refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.recompute import apply_recompute
from plait.train.config.settings import TrainConfig, check_strategies
from plait.bench.meter import ActivationMeter


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _step(recompute: bool) -> tuple[float, list[torch.Tensor], int]:
    model = build_gpt(get_preset("tiny"), 0)
    if recompute:
        assert apply_recompute(model) == 2
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    meter = ActivationMeter()
    with meter.track(model):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], meter.last


def test_recomputation_gives_the_same_gradients_to_the_bit_and_saves_less():
    loss, grads, saved = _step(recompute=False)
    loss_r, grads_r, saved_r = _step(recompute=True)
    assert loss_r == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    # Each block keeps its input only: b·s·h·4 = 2·32·64·4 bytes instead of everything.
    assert saved_r < saved / 3


def test_recompute_policy_and_model_are_checked():
    with pytest.raises(PlaitError, match="unknown --recompute 'some'"):
        apply_recompute(build_gpt(get_preset("tiny"), 0), "some")
    with pytest.raises(PlaitError, match="Linear has no blocks that can recompute"):
        apply_recompute(torch.nn.Linear(2, 2))
    model = build_gpt(get_preset("tiny"), 0)
    apply_recompute(model, "full")
    apply_recompute(model, "none")
    assert not any(block.recompute for block in model.blocks)


def test_zb_h1_with_recompute_is_refused():
    config = TrainConfig(model="tiny", pp=2, grad_accum=2, schedule="zb-h1", recompute="full")
    with pytest.raises(PlaitError, match="--recompute full cannot run the zb-h1 schedule"):
        check_strategies(config)


def test_the_pipeline_runner_refuses_recompute_with_a_split_backward():
    from plait.parallel.pipeline.runner import PipelineRunner, apply_pipeline
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh

    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    model = build_gpt(get_preset("tiny"), 0)
    apply_recompute(model)
    stages = apply_pipeline(model, mesh)
    with pytest.raises(PlaitError, match="--recompute full cannot run the zb-h1 schedule"):
        PipelineRunner(stages, mesh, "zb-h1")
