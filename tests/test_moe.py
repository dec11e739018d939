"""Mixture of experts without a world: the experts' grouped compute against a per-token loop,
the routers, the balancing loss's gradient, capacity, the parameter counts, and every
refusal `plait train --ep` prints before spawning (one line and a hint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.cli import main
from plait.errors import PlaitError
from plait.layout import Layout
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.models.gpt.moe import MoE, Experts, balance_loss
from plait.estimate.experts import dispatch_bytes, uniform_rows


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("plait: error: ") and lines[1].startswith("  hint: "), lines
    return lines[0]


def test_the_grouped_experts_equal_a_loop_over_tokens_in_fp64() -> None:
    torch.manual_seed(0)
    experts = Experts(4, 8, 6).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x, index, weight = torch.randn(10, 8, dtype=torch.float64), torch.randint(0, 4, (10, 2)), torch.rand(10, 2)
    index[:, 1] = (index[:, 0] + 1) % 4  # distinct choices, expert 3 possibly empty
    expected = torch.zeros(10, 8, dtype=torch.float64)
    for t in range(10):
        for j in range(2):
            gate, up = (x[t] @ experts.gate_up_proj[index[t, j]].t()).chunk(2)
            expected[t] += weight[t, j] * ((F.silu(gate) * up) @ experts.down_proj[index[t, j]].t())
    assert (experts(x, index, weight.double()) - expected).abs().max().item() < 1e-12


def test_the_balancing_loss_reaches_the_gradients_as_if_added_to_the_loss() -> None:
    config = get_preset("tiny-moe", aux_loss_coef=0.3, shared_experts=0)
    torch.manual_seed(0)
    moe = MoE(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, config.d_model, dtype=torch.float64)
    moe(x).sum().backward()  # AuxLoss: the output untouched, coef · aux's gradient added
    injected = [p.grad.clone() for p in moe.parameters() if p.requires_grad]
    moe.zero_grad()
    moe.aux_loss_coef = 0.0  # now add it by hand
    out = moe(x)
    index, _, probs = moe.route(moe.gate(x.reshape(-1, config.d_model)))
    (out.sum() + 0.3 * balance_loss(index, probs.view(2, 8, -1), moe.top_k)).backward()
    for a, b in zip(injected, [p.grad for p in moe.parameters() if p.requires_grad]):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-6, atol=1e-9)


def test_the_sigmoid_router_picks_by_score_plus_bias_and_weighs_by_score() -> None:
    moe = MoE(get_preset("tiny-moe", router="sigmoid", top_k=1))
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    moe.expert_bias.data = torch.tensor([0.0, 0.0, 0.0, 5.0])
    index, weight, probs = moe.route(scores)
    assert index.tolist() == [[3]] and weight.tolist() == [[1.0]]  # renormalised over the one choice
    assert probs[0, 3].item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_a_capacity_factor_drops_and_counts_what_exceeds_it() -> None:
    moe = MoE(get_preset("tiny-moe", top_k=1, capacity_factor=1.0))
    moe.train()
    index = torch.zeros(8, 1, dtype=torch.long)  # all 8 to expert 0; capacity 1.0 · 8 / 4 = 2
    with torch.enable_grad():
        kept = moe._drop_over_capacity(index, torch.ones(8, 1))
    assert kept.flatten().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert moe.dropped.item() == 6


def test_the_routing_counts_stay_exact_in_a_model_cast_to_bf16() -> None:
    """The counts are integers, which a cast of the model leaves alone: 1,000 tokens to one
    expert count 1,000 in a bf16 model (bf16 holds integers exactly only up to 256: float
    counts cast with the model read 1,000 as 1,000 but summed 257 + 1 as 256)."""
    moe = MoE(get_preset("tiny-moe", top_k=1)).to(torch.bfloat16)
    moe.train()
    assert moe.tokens_per_expert.dtype == moe.dropped.dtype == torch.int64
    with torch.enable_grad():
        for _ in range(1000):
            moe.count(torch.zeros(1, 1, dtype=torch.long))
    assert moe.take_counts().tolist() == [1000, 0, 0, 0]


def test_the_balancing_bias_keeps_moving_in_a_model_cast_to_bf16() -> None:
    """The sigmoid router's bias stays fp32 through the model's cast (and a move): at 0.6,
    bf16's spacing is 0.0039, and a bf16 bias moved by 0.001 a step stayed where it was."""
    moe = MoE(get_preset("tiny-moe", router="sigmoid")).to(torch.bfloat16).to("cpu")
    assert moe.gate.weight.dtype == torch.bfloat16 and moe.expert_bias.dtype == torch.float32
    with torch.no_grad():
        moe.expert_bias.fill_(0.6)
    for _ in range(3):
        moe.after_routing(torch.tensor([10, 0, 0, 0]))  # expert 0 over the mean, the others under
    assert moe.expert_bias.tolist() == pytest.approx([0.597, 0.603, 0.603, 0.603], abs=1e-6)
    x = torch.randn(2, 4, moe.gate.in_features, dtype=torch.bfloat16)
    assert moe(x).dtype == torch.bfloat16  # routing reads the fp32 bias beside the bf16 scores


def test_evaluation_routes_every_token_so_no_grouping_or_padding_changes_a_score() -> None:
    """Held-out samples are dealt over dp and short micro-batches padded: under a capacity
    factor, the tokens sharing a forward would change what is dropped. In eval mode nothing
    is, so each sample's output is its own whatever rides beside it; training still drops."""
    torch.manual_seed(0)
    moe = MoE(get_preset("tiny-moe", capacity_factor=0.5))
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(2, 8, moe.gate.in_features)
    pad = x[:1].expand(3, -1, -1)  # copies of sample 0, as evaluation pads
    moe.eval()
    with torch.no_grad():
        alone, padded = moe(x), moe(torch.cat([x, pad]))[:2]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)
    moe.train()
    with torch.no_grad():
        assert (moe(x) - moe(torch.cat([x, pad]))[:2]).abs().max() > 1e-2  # the capacity binds in training


def test_the_parameter_counts_follow_the_experts() -> None:
    config = get_preset("tiny-moe")
    model = build_gpt(config, 0)
    assert config.num_params() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    idle = (config.experts - config.top_k) * config.expert_params() * config.moe_layers
    assert config.active_params() == config.num_params() - idle
    dense = get_preset("tiny")
    assert dense.num_params() == sum(p.numel() for p in build_gpt(dense, 0).parameters())
    assert get_preset("small-moe").moe_layers == 3  # every second of 6 blocks


def test_the_dispatch_formula() -> None:
    # forward: (ep-1)/ep of 8E bytes of counts, and the rows both ways; backward the rows again
    assert dispatch_bytes(3, 5, 256, 8, 4, backward=False) == 0.75 * 64 + 8 * 256
    assert dispatch_bytes(3, 5, 256, 8, 4, backward=True) == 0.75 * 64 + 2 * 8 * 256
    assert uniform_rows(64, 2, 4) == 96.0


@pytest.mark.parametrize("model, words", [
    ("tiny-moe,top_k=5", "top_k = 5 is more than experts = 4"),
    ("tiny-moe,router=hash", "router 'hash' is not one of softmax, sigmoid"),
])
def test_a_shape_that_cannot_route_is_refused(model: str, words: str) -> None:
    with pytest.raises(PlaitError, match=words):
        get_preset(model)


@pytest.mark.parametrize("flags, words", [
    (["--model", "tiny-moe", "--nproc", "4", "--ep", "3"], "--ep 3 does not divide dp = 4"),
    (["--model", "tiny-moe,experts=6", "--nproc", "4", "--ep", "4"], "experts = 6 is not divisible by --ep 4"),
    (["--model", "tiny", "--nproc", "2", "--ep", "2"], "--ep 2 splits the experts, and the model has none"),
    (["--model", "tiny-moe", "--nproc", "4", "--ep", "2", "--cp", "2"],
     "--ep 2 with --cp 2: expert parallelism with context parallelism is not built yet"),
    (["--model", "tiny-moe", "--nproc", "2", "--tp", "2", "--sp"], "--sp with a mixture of experts is not built yet"),
    (["--model", "tiny-moe,top_k=9"], "top_k = 9 is more than experts = 4"),
])
def test_a_bad_expert_layout_is_refused_in_one_line(flags: list[str], words: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(["train", *flags, "--out", str(tmp_path)], capsys)
    assert words in line, line


def test_the_layout_record_folds_ep_into_dp() -> None:
    layout = Layout.fill(8, ep=4)
    assert (layout.dp, layout.ep, layout.world) == (8, 4, 8)
    assert "ep=4" in layout.describe()


def test_a_transformers_moe_whose_layout_plait_does_not_know_is_refused_in_one_line() -> None:
    transformers = pytest.importorskip("transformers")
    from plait.models.hf.experts import declared_experts

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(PlaitError, match="declares no base_model_ep_plan"):
        declared_experts(model, {})
    with pytest.raises(PlaitError, match="uses 'ep_router', which plait does not split"):
        declared_experts(model, {"model.layers.*.mlp.gate": "ep_router"})
    with pytest.raises(PlaitError, match=r"MixtralTopKRouter\) has no num_experts"):
        del model.model.layers[0].mlp.gate.num_experts
        declared_experts(model, {"model.layers.*.mlp.gate": "ep_dispatch_experts"})
    assert declared_experts(model, {"model.layers.*.mlp.experts": "ep_dispatch_experts"}) == \
        [model.model.layers[0].mlp.experts]
    # tp words beside the experts (Gemma 4's dense MLP) are left whole, not refused
    assert declared_experts(model, {"model.layers.*.mlp.experts": "ep_dispatch_experts",
                                    "model.layers.*.self_attn.q_proj": "colwise"}) == [model.model.layers[0].mlp.experts]


def test_experts_run_on_every_token_dispatch_every_experts_rows_and_no_counts() -> None:
    """Llama 4's experts take every token (GPTConfig.tp_expert_rows = E): under ep each rank sends
    every other rank's experts their rows of every token, and no counts (DenseExpertDispatch),
    where a top-k dispatch sends k rows a token after the counts. Had the estimate priced k rows,
    it would have been E / k times under what such a model sends."""
    from dataclasses import replace

    from plait.estimate.experts import layer_alltoall
    from plait.estimate.layout import Workload

    routed = replace(get_preset("tiny-moe"), top_k=1)
    dense = replace(routed, tp_expert_rows=routed.experts)
    layout = Workload(dp=2, ep=2, micro_batch=2, seq_len=32, precision="fp32")
    row = routed.d_model * 4
    away = (2 - 1) * (routed.experts // 2) * 2 * 32  # DenseExpertDispatch: other ranks' experts, every token
    assert layer_alltoall(dense, layout) == {"forward": 2 * away * row, "backward": 2 * away * row}
    assert layer_alltoall(routed, layout)["forward"] == 8 * routed.experts / 2 + 2 * (2 * 32 / 2) * row


def test_the_estimate_holds_experts_over_ep_and_counts_flops_by_active_parameters() -> None:
    from plait.estimate import estimate_layout

    config = get_preset("tiny-moe")
    experts = config.moe_layers * config.experts * config.expert_params()
    dense_part = config.num_params() - experts
    work = dict(dp=4, micro_batch=2, seq_len=32, hardware="cpu")
    for ep in (1, 2, 4):
        result = estimate_layout(config, ep=ep, **work)
        biases = config.moe_layers * config.experts  # the router's balancing biases, outside num_params
        assert result["memory"]["params"] == (dense_part + experts // ep + biases) * 4
        rows = 2 * 32 * config.top_k * (ep - 1) / ep  # uniform routing: all but the 1/ep kept
        per_layer = (ep - 1) / ep * 8 * config.experts + 2 * rows * config.d_model * 4 + 2 * rows * config.d_model * 4
        assert result["comm"].get("ep", {}).get("all_to_all", 0.0) == pytest.approx(config.moe_layers * per_layer)
        edp = 4 // ep
        assert result["comm"].get("edp", {}).get("all_reduce", 0.0) == pytest.approx(
            2 * (edp - 1) / edp * experts // ep * 4 if ep > 1 else 0.0)
    active = sum(config.active_block_params(i) for i in range(config.n_layers)) + config.vocab_size * config.d_model
    flops = estimate_layout(config, ep=2, **work)["time"]["flops_per_token"]
    assert flops == 6 * active + 3 * 4 * config.n_layers * config.d_model * 32
    assert estimate_layout(config, ep=2, **work)["model"]["active_params"] == config.active_params()


def test_the_closing_report_shows_the_routing_and_the_all_to_all() -> None:
    from plait.report.closing import experts_line

    line = experts_line({"per_layer": [{"min": 10, "mean": 16, "max": 25}], "aux_loss_first": 1.2,
                         "aux_loss_last": 1.01, "dropped": 3, "alltoall_measured": 2048.0,
                         "alltoall_formula": 2048.0}, {"comm": {"ep": {"all_to_all": 1024.0}}})
    assert "tokens per expert min/mean/max by MoE layer: 10/16/25; balancing loss 1.200 -> 1.010; dropped 3" in line
    assert "measured 2.0 KiB, formula on this routing 2.0 KiB, predicted (uniform routing) 1.0 KiB" in line


def test_plait_plan_proposes_expert_parallelism_for_a_mixture_of_experts() -> None:
    from plait.estimate.planner import plan

    rows = plan(get_preset("mixtral-8x7b"), gpus=16, global_batch=64, seq_len=4096, top=20)
    # Without a pipeline, split experts are within 1% of the best layout (ZeRO-3, whose gathers
    # hide behind the compute on the nodes' NICs, where ep's all-to-alls cross on each rank's
    # own), and lighter than it in memory. The first rows split the experts 8 ways over two
    # stages without recompute (76.7 GiB of 78, since SwiGLU's product is made again for
    # down's backward), 8% ahead of the best without ep (8 stages over cp 2, ZeRO-2).
    flat = next(r for r in rows if r["pp"] == 1)
    split = next(r for r in rows if r["pp"] == 1 and r["ep"] > 1)
    assert split["step_s"] <= flat["step_s"] * 1.01 and split["memory_bytes"] < flat["memory_bytes"]
    assert rows[0]["ep"] > 1 and rows[0]["step_s"] <= 0.95 * min(r["step_s"] for r in rows if r["ep"] == 1)
    assert all(r["ep"] == 1 or (r["dp"] % r["ep"] == 0 and 8 % r["ep"] == 0 and r["tp"] == 1) for r in rows)
    assert all(r["ep"] == 1 for r in plan(get_preset("small"), gpus=4, global_batch=8, seq_len=256))


def test_a_capacity_factor_under_cp_is_refused_before_spawning() -> None:
    from plait.families import family_of
    from plait.train.config.settings import build_config, validate

    config = build_config({}, {"model": "tiny-moe,capacity_factor=1.0", "cp": "2", "nproc": "2"}, family_of)
    with pytest.raises(PlaitError, match="under cp 2 a rank holds part of each sequence"):
        validate(config, family_of(config))


def test_an_ep_plan_plait_cannot_split_is_refused_only_when_the_run_splits_experts(tmp_path: Path) -> None:
    """A transformers MoE declaring a style plait does not split trains on one process (its
    routing left uncounted) and is refused, in one line, at ep 2."""
    transformers = pytest.importorskip("transformers")
    from dataclasses import replace

    from plait.families.hf.task import HFTask
    from plait.train.config.settings import TrainConfig

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    config.base_model_ep_plan = {"layers.*.mlp.gate": "ep_router"}
    config.save_pretrained(tmp_path / "mixtral")
    run = TrainConfig(model=f"hf:{tmp_path / 'mixtral'}", nproc=1)
    model = HFTask(run).build_model(0)
    assert sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(PlaitError, match="uses 'ep_router', which plait does not split"):
        HFTask(replace(run, ep=2, dp=2, nproc=2)).build_model(0)
