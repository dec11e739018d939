"""transformers models trained by the plans they declare match one process, on 2 ranks.

One spawn (tests/worlds/hf_plans_world.py): a Qwen3 (per-head q/k norms, tied embeddings)
and a Mistral (sliding window) under tp 2, tp 2 + SP, pp 2 and dp 2 × ZeRO-3, a Phi-3 (fused
layers gathered whole) under tp 2 ± SP, AdamW with accumulation 2: every step's loss, the
first step's gradients (under tp) and the final parameters against one process (rtol 1e-5
for ZeRO, 1e-4 where tp or pp changes the summation order). And a Llama's declared plan
moves exactly the tp bytes of the hand-written region plan it replaces.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.parity import assert_losses_close, assert_params_close, assert_scale_close
from tests.worldlib import run_world

pytest.importorskip("transformers")

RTOL = {"tp": 1e-4, "tp_sp": 1e-4, "pp": 1e-4, "zero3": 1e-5}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("hf_plans_world.py", 2, tmp_path_factory.mktemp("hf_plans"))
    return reports


def params_of(world: list[dict[str, Any]], family: str, run: str) -> dict[str, list[float]]:
    """The whole model's parameters after a run: rank 0's, or under pp both ranks' stages."""
    merged: dict[str, list[float]] = {}
    for report in world:
        merged.update(report[family][run]["params"])
    return merged


@pytest.mark.parametrize("family,run", [(family, run) for family in ("qwen3", "mistral")
                                        for run in ("tp", "tp_sp", "pp", "zero3")]
                         + [("phi3", "tp"), ("phi3", "tp_sp")])
def test_declared_plans_train_like_one_process(world: list[dict[str, Any]], family: str, run: str) -> None:
    expected = world[0][family]["reference"]
    for report in world:
        assert_losses_close(report[family][run]["losses"], expected["losses"], rtol=RTOL[run])
    assert_params_close(params_of(world, family, run), expected["params"], rtol=RTOL[run])


@pytest.mark.parametrize("family", ["qwen3", "mistral", "phi3"])
@pytest.mark.parametrize("run", ["tp", "tp_sp"])
def test_declared_tensor_parallel_gradients_match_one_process(world: list[dict[str, Any]], family: str,
                                                              run: str) -> None:
    """The first step's gradients, whole: each one summed over tp exactly once (a per-head
    q_norm's by its declared style, a layer norm's under SP by plait's), none left partial."""
    expected = world[0][family]["reference"]["grads"]
    for report in world:
        grads = report[family][run]["grads"]
        assert grads.keys() == expected.keys()
        for name in expected:
            assert_scale_close(grads[name], expected[name])


@pytest.mark.parametrize("run", ["declared", "declared_sp", "hand", "hand_sp"])
def test_llama_by_its_declared_plan_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    expected = world[0]["llama"]["reference"]
    for report in world:
        assert_losses_close(report["llama"][run]["losses"], expected["losses"], rtol=1e-4)
    assert_params_close(params_of(world, "llama", run), expected["params"], rtol=1e-4)


@pytest.mark.parametrize("declared,hand", [("declared", "hand"), ("declared_sp", "hand_sp")])
def test_declared_plan_moves_the_bytes_of_the_hand_region_plan(world: list[dict[str, Any]], declared: str,
                                                               hand: str) -> None:
    """q, k and v (gate and up) enter the region once, as under a hand "region" mark: the
    same collectives, of the same sizes, every step."""
    for report in world:
        steps = report["llama"][declared]["tp_bytes"]
        assert steps == report["llama"][hand]["tp_bytes"]
        assert all(step.get("all_reduce") or step.get("reduce_scatter") for step in steps)
