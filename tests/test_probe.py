"""Exact or refused: a split that would train another model stops before training, in one line.

tests/worlds/probe_world.py plants one defect per axis (tp, cp, ep, a user's tp plan) on 2
ranks; plait.parallelize must refuse each on every rank with the same one line, naming the
module whose output first differs from the whole model's, while the same models without
the defect pass. The full-model matrix of families is tests/test_hf_sweep.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from plait.errors import PlaitError
from plait.parallel.tensor.styles import resolve_plan
from tests.worldlib import run_world

pytest.importorskip("transformers")

from tests.hf_versions import declares_dispatched_experts, older_moe_reason  # noqa: E402

# Under the older MoE layout the clean Mixtral case is plait's one-line refusal, and its
# planted defect has nothing to plant into.
OLD_MOE_LAYOUT = not declares_dispatched_experts()

# the module each planted defect must be named by: the first whose output differs
FIRST_DIFFERENT = {"gemma-tp": "model.embed_tokens (GemmaTextScaledWordEmbedding)",
                   "gemma2-tp": "model.embed_tokens (Gemma2TextScaledWordEmbedding)",
                   "gemma3_text-tp": "model.embed_tokens (Gemma3TextScaledWordEmbedding)",
                   "llama-cp": "model.rotary_emb (LlamaRotaryEmbedding)",
                   "gpt-cp": "blocks.0.attn.o_proj",  # the attention core is no module: its projection
                   "mixtral-ep": "model.layers.0.mlp.experts",
                   "gpt-moe-ep": "blocks.0.mlp.experts",
                   "llama-plan": "model.layers.0.mlp.up_proj",
                   "llama-grad": "the gradient of model.layers.0.input_layernorm.weight differs",
                   # the same, every gradient compared through random projections (a large one's way)
                   "llama-grad-projected": "the gradient of model.layers.0.input_layernorm.weight differs"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("probe_world.py", 2, tmp_path_factory.mktemp("probe"))
    return reports


@pytest.mark.parametrize("case", sorted(FIRST_DIFFERENT))
def test_a_planted_defect_is_refused_in_one_line_naming_the_module(world: list[dict[str, Any]], case: str) -> None:
    if case == "mixtral-ep" and OLD_MOE_LAYOUT:
        pytest.skip(older_moe_reason())
    lines = [rank["defect"][case].get("refused") for rank in world]
    assert lines[0] is not None, f"{case}: the split trained: {world[0]['defect'][case]}"
    assert lines[0] == lines[1], "every rank refuses with the same line"
    assert "\n" not in lines[0]
    assert ("trains another model than" in lines[0] or " fails on a probe" in lines[0]), lines[0]
    assert FIRST_DIFFERENT[case] in lines[0], lines[0]


def test_the_same_models_without_the_defect_pass(world: list[dict[str, Any]]) -> None:
    for rank in world:
        for case, verdict in rank["clean"].items():
            if case == "mixtral-ep" and OLD_MOE_LAYOUT:
                assert "ep plan uses 'ep_router', 'moe_tp_experts', which plait does not split" in verdict["refused"]
                continue
            assert "refused" not in verdict, (case, verdict)
            assert verdict["seconds"] > 0


class Scaled(nn.Linear):
    """A linear layer with arithmetic of its own, which a column or row layer would drop."""

    def forward(self, x):  # noqa: ANN001, ANN201
        return super().forward(x) * 2


def test_a_linear_subclass_with_its_own_forward_is_refused_for_column_and_row() -> None:
    model = nn.Sequential(Scaled(4, 4), nn.Linear(4, 4))
    for style in ("column", "row"):
        with pytest.raises(PlaitError, match=r"0 is a Scaled, whose forward does more than nn.Linear's"):
            resolve_plan(model, {"0": style})
    assert resolve_plan(model, {"1": "row"}) == {"1": "row"}
    # split by vocabulary, a head keeps its forward (tensor/layers.split_head_in_place: Dory's)
    assert resolve_plan(model, {"0": "vocab"}) == {"0": "vocab"}


def test_a_lone_ranks_failure_in_the_probe_ends_every_rank_at_once(tmp_path) -> None:
    """Not after the collective timeout (120 s here) that the other rank would wait out."""
    import time

    start = time.perf_counter()
    proc, _ = run_world("probe_lone.py", 2, tmp_path, expect_ok=False, timeout=200)
    seconds = time.perf_counter() - start
    assert proc.returncode != 0 and seconds < 60, (proc.returncode, seconds)
    assert "RuntimeError: a fault of rank 1's split MLP" in proc.stderr, proc.stderr[-1500:]
    assert "fails on a probe of 8 tokens in blocks.0" in proc.stderr
