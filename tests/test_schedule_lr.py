"""The learning-rate schedule: linear warm-up, then cosine down to lr × min_lr_ratio."""

from __future__ import annotations

import math

import pytest

from plait.train.config.settings import TrainConfig
from plait.train.loop.trainer import lr_at


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def test_warmup_then_cosine_to_the_floor():
    config = TrainConfig(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, config) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, config) == 1.0
    assert lr_at(9, config) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, config) == pytest.approx(0.1)
    assert all(lr_at(s, config) >= lr_at(s + 1, config) for s in range(4, 14))
