"""Tensor parallelism without processes: plans, bad input, and the cost arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.models.config import get_preset
from plait.models.gpt import build_gpt
from plait.models.gpt_adapter import GPT_PLAN
from plait.parallel.tensor.plan import apply_tensor_parallel, lm_loss, resolve_plan, tp_loss_fn
from plait.rules import check_tensor_parallel as check_gpt_tensor_parallel
from plait.parallel.tensor.cost import (block_activations, korthikanti_gpt_bytes, layer_collectives,
                                        step_traffic)
from plait.parallel.tensor import regions
from plait.runtime.comm import Axis, Ledger

TINY = get_preset("tiny")


def fake_axis(size: int) -> Axis:
    """An axis of `size` ranks with no process group: fine for anything that fails before talking."""
    return Axis("tp", size, 0, None, Ledger())


# -- plans ------------------------------------------------------------------------------------
def test_gpt_plan_covers_every_layer_once() -> None:
    model = build_gpt(TINY, 0)
    styles = resolve_plan(model, GPT_PLAN)
    assert styles["embed"] == styles["lm_head"] == "vocab"
    assert styles["blocks.1.attn"] == styles["blocks.1.mlp"] == "region"
    assert {styles[f"blocks.0.attn.{p}_proj"] for p in "qkv"} == {"column"}
    assert styles["blocks.0.attn.o_proj"] == styles["blocks.0.mlp.down_proj"] == "row"
    assert styles["blocks.0.attn_norm"] == styles["norm"] == "sequence"
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert all(name in styles for name in linears)


def test_plan_typo_unknown_style_clash_and_wrong_kind() -> None:
    model = build_gpt(TINY, 0)
    with pytest.raises(PlaitError, match="matches no module") as info:
        resolve_plan(model, {"blocks.*.atn.q_proj": "column"})
    assert "blocks" in info.value.hint
    with pytest.raises(PlaitError, match="unknown style 'colum'"):
        resolve_plan(model, {"embed": "colum"})
    with pytest.raises(PlaitError, match="both 'column' and 'row'"):
        resolve_plan(model, {"blocks.*.attn.q_proj": "column", "blocks.0.attn.*": "row"})
    with pytest.raises(PlaitError, match="is a Embedding, but style 'row' needs Linear"):
        resolve_plan(model, {"embed": "row"})


def test_user_model_plan_checks_divisibility() -> None:
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    with pytest.raises(PlaitError, match=r"0.out_features = 6 is not divisible by tp=4") as info:
        apply_tensor_parallel(model, fake_axis(4), plan={"0": "column", "2": "row"})
    assert "1, 2, 3, 6" in info.value.hint


def test_a_model_other_than_the_gpt_needs_a_plan() -> None:
    with pytest.raises(PlaitError, match="needs a plan for a Sequential"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), fake_axis(2))


def test_tp_of_one_changes_nothing() -> None:
    model, dense = build_gpt(TINY, 0), build_gpt(TINY, 0)
    apply_tensor_parallel(model, fake_axis(1), sp=True)
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    torch.testing.assert_close(model(ids), dense(ids), rtol=0, atol=0)
    targets = torch.randint(0, TINY.vocab_size, (2, 9))
    expected = F.cross_entropy(dense(ids).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(tp_loss_fn(model)(model(ids), targets), expected)
    torch.testing.assert_close(lm_loss(model(ids), targets, reduction="sum"), expected * targets.numel())
    with pytest.raises(PlaitError, match="already applied"):
        apply_tensor_parallel(model, fake_axis(1))


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("config,tp,needle", [
    (TINY, 3, "n_heads = 4 is not divisible by tp=3"),
    (TINY, 4, "n_kv_heads = 2 is not divisible by tp=4"),
    (replace(TINY, n_kv_heads=4, vocab_size=250), 4, "vocab_size = 250 is not divisible by tp=4"),
    (replace(TINY, n_kv_heads=4, ffn_hidden=190), 4, "ffn_hidden = 190 is not divisible by tp=4"),
])
def test_gpt_shapes_that_do_not_split(config, tp: int, needle: str) -> None:
    with pytest.raises(PlaitError, match=needle):
        apply_tensor_parallel(build_gpt(config, 0), fake_axis(tp))


def test_vocab_error_suggests_the_padded_size() -> None:
    with pytest.raises(PlaitError) as info:
        check_gpt_tensor_parallel(replace(TINY, n_kv_heads=4, vocab_size=250), 4)
    assert "pad the vocabulary to 252" in info.value.hint


def test_sp_needs_the_sequence_divisible_by_tp() -> None:
    with pytest.raises(PlaitError, match="seq_len = 18, tp = 4"):
        check_gpt_tensor_parallel(replace(TINY, n_kv_heads=4), 4, sp=True, seq_len=18)
    check_gpt_tensor_parallel(replace(TINY, n_kv_heads=4), 4, sp=False, seq_len=18)
    with pytest.raises(PlaitError, match="17 tokens over tp=2"):
        regions.reduce_scatter_sequence(torch.zeros(1, 17, 4), fake_axis(2))


# -- cost arithmetic --------------------------------------------------------------------------
def test_block_activations_split_as_theory_says() -> None:
    config = replace(TINY, n_heads=8, n_kv_heads=4)
    b, s, h, f, a = 2, 16, config.d_model, config.ffn_hidden, config.n_heads
    one = block_activations(config, b, s)
    assert one.total == s * b * (11 * h + 4 * f + a + 2)
    for t in (2, 4):
        tp, sp = block_activations(config, b, s, t), block_activations(config, b, s, t, sp=True)
        assert tp.outside == one.outside and tp.inside == one.inside / t  # TP alone: insides only
        assert sp.total == one.total / t  # TP + SP: everything
        whole = block_activations(config, b, s, t, sp=True, regather=False)
        assert whole.total == sp.total + 2 * s * b * h * (1 - 1 / t)  # the two region inputs stay whole
    # One head per rank: o_proj reads a view of SDPA's output, one sbh/t fewer.
    assert block_activations(config, b, s, 8).inside == one.inside / 8 - s * b * h / 8


def test_korthikanti_formulas() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, the paper's table 2 scale
    one = korthikanti_gpt_bytes(s, b, h, a)
    assert one == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_gpt_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_gpt_bytes(s, b, h, a, t=8, sp=True) == pytest.approx(one / 8)


def test_sp_moves_the_same_bytes_as_tp_unless_it_regathers() -> None:
    assert layer_collectives(2, sp=False) == {"all_reduce": 4}
    assert layer_collectives(2, sp=True, regather=False) == {"all_gather": 4, "reduce_scatter": 4}
    assert layer_collectives(2, sp=True) == {"all_gather": 6, "reduce_scatter": 4}
    assert layer_collectives(1, sp=True) == {}
    for t in (2, 4, 8):
        tp = step_traffic(TINY, 2, 16, t)
        sp = step_traffic(TINY, 2, 16, t, sp=True, regather=False)
        loss = 2 * (t - 1) / t * 3 * 2 * 16 * 4
        assert sp["all_gather"] + sp["reduce_scatter"] == pytest.approx(tp["all_reduce"] - loss)
        regather = step_traffic(TINY, 2, 16, t, sp=True)
        extra = (t - 1) / t * (TINY.n_layers * 2 + 1) * 2 * 16 * TINY.d_model * 4
        assert regather["all_gather"] - sp["all_gather"] == pytest.approx(extra)
