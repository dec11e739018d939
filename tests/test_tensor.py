"""Tensor parallelism without processes: plans, bad input, and what it moves (plait.estimate)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.models.gpt.adapter import GPT_PLAN
from plait.parallel.tensor.plan import apply_tensor_parallel, lm_loss, resolve_plan, tp_loss_fn
from plait.estimate.layout import Workload, stages
from plait.estimate.traffic import tp_traffic
from plait.parallel.tensor import ops
from plait.runtime.comm import Axis, Ledger

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


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
        replace(TINY, n_kv_heads=4, vocab_size=250).check_split(4)
    assert "pad the vocabulary to 252" in info.value.hint


def test_sp_needs_the_sequence_divisible_by_tp() -> None:
    with pytest.raises(PlaitError, match="seq_len = 18, tp = 4"):
        replace(TINY, n_kv_heads=4).check_split(4, sp=True, seq_len=18)
    replace(TINY, n_kv_heads=4).check_split(4, sp=False, seq_len=18)
    with pytest.raises(PlaitError, match="17 tokens over tp=2"):
        ops.reduce_scatter_sequence(torch.zeros(1, 17, 4), fake_axis(2))


# -- what it moves, as plait.estimate predicts it ------------------------------------------
def tp_bytes(t: int, sp: bool = False) -> dict[str, float]:
    """plait.estimate's tp traffic of one forward and backward of the tiny GPT (b 2, s 16)."""
    work = Workload(tp=t, sp=sp, micro_batch=2, seq_len=16, precision="fp32")
    return tp_traffic(TINY, work, stages(TINY, t, 1)[0])["tp"]


def test_sp_moves_the_same_bytes_as_tp_but_for_its_regathers() -> None:
    """SP turns each all-reduce into a reduce-scatter and an all-gather (the same bytes), and
    all-gathers each region's saved input again in backward (2 per block, 1 for the head)."""
    for t in (2, 4, 8):
        tp, sp = tp_bytes(t), tp_bytes(t, sp=True)
        loss = 2 * (t - 1) / t * 3 * 2 * 16 * 4
        norms = 2 * (t - 1) / t * (2 * TINY.n_layers + 1) * TINY.d_model * 4  # SP sums the norms' grads
        regathers = (t - 1) / t * (TINY.n_layers * 2 + 1) * 2 * 16 * TINY.d_model * 4
        assert sp["all_gather"] - regathers + sp["reduce_scatter"] == pytest.approx(tp["all_reduce"] - loss)
        assert sp["all_reduce"] == pytest.approx(loss + norms)
