"""--stack: one layout priced as another framework runs it (plait/estimate/stacks.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.errors import PlaitError
from plait.estimate import estimate_layout
from plait.estimate.hardware import get_hardware
from plait.estimate.layout import Workload, layout_stages
from plait.estimate.ops import accumulate_s, attention_time, elementwise_s
from plait.estimate.planner import plan
from plait.estimate.stacks import STACKS
from plait.estimate.network import collective_s, inter_node
from plait.estimate.time import estimate_time
from plait.models.gpt.config import GPTConfig

A100 = get_hardware("a100-80gb")
GPT = GPTConfig(vocab_size=51200, n_layers=4, d_model=1024, n_heads=16, n_kv_heads=16, ffn_hidden=4096,
                max_seq_len=2048, arch="gpt2")


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def work(stack: str, **fields: object) -> Workload:
    return Workload(**{"dp": 1, "tp": 2, "precision": "bf16", "micro_batch": 2, "seq_len": 2048,
                       "recompute": "full", "stack": stack, **fields})


def test_eager_attention_pays_its_passes_over_the_scores(monkeypatch) -> None:
    """Megatron-LM's attention of 2021 writes the a·s·s scores and passes over them: 6.5
    times forward and 9.5 backward with dropout (4 and 7 without), each pass 2 bytes a score
    at the memory's bandwidth; its two products run as GEMMs. A fused kernel never writes them."""
    eager, fused = work("megatron-2021"), work("plait")
    scores = 2 * 2048 * (16 // 2) * 2048  # micro-batch × tokens × heads on a tp rank × keys
    flops = 4.0 * 2 * 2048 * 2048 * 1024 / 2 * 4  # QKᵀ and ·V: two forwards and a backward (two more)
    gemms, memory = flops / (312e12 * A100.compute_efficiency), scores * 2 / (A100.memory_gb_s * 1e9)
    assert attention_time(GPT, eager, A100, 2, 1) == pytest.approx(gemms + memory * (6.5 * 2 + 9.5), rel=1e-12)
    assert attention_time(GPT, eager, A100, 1) == pytest.approx(gemms / 4 + memory * 6.5, rel=1e-12)  # the cp ring's
    assert attention_time(GPT, eager, A100, 0, 1) == pytest.approx(gemms / 2 + memory * 9.5, rel=1e-12)
    assert attention_time(GPT, fused, A100, 2, 1) == pytest.approx(flops / (312e12 * A100.attention_efficiency))
    monkeypatch.setitem(STACKS, "megatron-2021", replace(STACKS["megatron-2021"], dropout=False))
    assert attention_time(GPT, eager, A100, 2, 1) == pytest.approx(gemms + memory * (4 * 2 + 7), rel=1e-12)


def test_megatron_fuses_what_plaits_gpt_runs_op_by_op() -> None:
    """Per token per block on a tp rank, forward: Megatron's fused LayerNorms and
    bias-dropout-adds move 11 h (each rank, without SP), its QKV bias, the attention output's
    permute and bias-GeLU 4h/t + 4kv/t + 2f/t; plait's GPT in 16-bit (EW_FWD_16, its norms
    over fp32 copies) 53h + 8kv/t + 5f/t."""
    h, t, tokens = 1024, 2, 2 * 2048
    megatron = elementwise_s(GPT, work("megatron-2021"), A100, 1, False, False)
    want = (11 * h + 4 * h / t + 4 * h / t + 2 * 4096 / t) * tokens * 2 / (A100.memory_gb_s * 1e9)
    assert megatron == pytest.approx(want, rel=1e-12)
    plait = elementwise_s(GPT, work("plait"), A100, 1, False, False)
    assert plait == pytest.approx((53 * h + 8 * h / t + 5 * 4096 / t) * tokens * 2 / (A100.memory_gb_s * 1e9), rel=1e-12)
    core = elementwise_s(GPT, work("megatron-core"), A100, 1, False, False)  # no dropout: 10h on each rank
    with_sp = elementwise_s(GPT, work("megatron-core", sp=True), A100, 1, False, False)
    assert with_sp == pytest.approx(core - 10 * (h - h / t) * tokens * 2 / (A100.memory_gb_s * 1e9), rel=1e-12)


def test_reducing_after_backward_exposes_the_whole_reduction() -> None:
    """Megatron-LM's DDP of 2021 all-reduced after the schedule: the step waits for all of it.
    plait's buckets hide behind the last backward, all but the last one."""
    after = work("megatron-2021", dp=8, tp=1, recompute="none")
    behind = replace(after, stack="plait")
    stage = layout_stages(GPT, after)[0]
    grads = stage.params * after.reduce_bytes
    buckets = max(1.0, stage.params * 2 / after.bucket_bytes)
    whole = collective_s("all_reduce", grads, 8, A100, inter_node(after, 8)["dp"], buckets)
    assert estimate_time(GPT, after, A100, 8).dp_s == pytest.approx(whole, rel=1e-12)
    assert estimate_time(GPT, behind, A100, 8).dp_s < 0.5 * whole


def test_megatron_core_gathers_zero_1_weights_behind_the_next_forward() -> None:
    """--overlap-param-gather: ZeRO-1's all-gather hides behind the first forward, all but its
    first bucket (here the forward is long enough to hide the rest); plait gathers after the
    step, all of it exposed."""
    gpt = replace(GPT, n_layers=24)
    core = Workload(dp=64, zero=1, precision="bf16", micro_batch=16, seq_len=2048, stack="megatron-core")
    step_core, step_plait = (estimate_time(gpt, w, A100, 8) for w in (core, replace(core, stack="plait")))
    stage, inter = layout_stages(gpt, core)[0], inter_node(core, 8)["dp"]
    gather = collective_s("all_gather", stage.params * 2, 64, A100, inter, stage.params * 2 / core.bucket_bytes)
    first = collective_s("all_gather", core.bucket_bytes, 64, A100, inter)
    assert first < 0.2 * gather
    assert step_core.dp_s == pytest.approx(step_plait.dp_s - gather + first, rel=1e-9)


def test_the_stack_reaches_the_report_the_planner_and_refuses_a_name_it_does_not_know() -> None:
    report = estimate_layout(GPT, work("megatron-2021"), hardware="a100-80gb")
    assert report["layout"]["stack"] == "megatron-2021"
    assert any("as megatron-2021 runs it" in note for note in report["assumptions"])
    plain = estimate_layout(GPT, work("plait"), hardware="a100-80gb")
    assert report["time"]["step_s"] != plain["time"]["step_s"]
    best = plan(GPT, gpus=8, global_batch=16, seq_len=2048, hardware="a100-80gb", top=1, stack="megatron-core")[0]
    assert best["stack"] == "megatron-core"
    with pytest.raises(PlaitError, match="unknown --stack 'deepspeed'") as err:
        work("deepspeed")
    assert all(name in err.value.hint for name in STACKS)


@pytest.mark.parametrize("stack, fields, lacks", [
    ("megatron-2021", {"sp": True}, "sequence parallelism"),
    ("megatron-2021", {"dp": 2, "zero": 1}, "ZeRO stage 1"),
    ("megatron-2021", {"recompute": "selective"}, "selective recomputation"),
    ("megatron-deepspeed", {"pp": 2, "grad_accum": 4, "schedule": "interleaved", "virtual_stages": 2},
     "the interleaved schedule"),
    ("megatron-core", {"cp": 2, "cp_kind": "ulysses"}, "ulysses context parallelism"),
    ("megatron-core", {"dp": 4, "zero": 3}, "ZeRO stage 3"),
    ("llm-foundry", {"pp": 2, "grad_accum": 4}, "pipeline parallelism"),
    ("llm-foundry", {"dp": 2, "zero": 1}, "ZeRO stage 1"),
])
def test_a_stack_refuses_what_its_framework_cannot_run(stack: str, fields: dict, lacks: str) -> None:
    """One line naming what is missing; `plait plan --stack` never proposes such a layout."""
    with pytest.raises(PlaitError, match=f"--stack {stack} has no {lacks}"):
        work(stack, **fields)


def test_a_plan_on_a_stack_stays_within_what_it_runs() -> None:
    rows = plan(GPT, gpus=16, global_batch=32, seq_len=2048, hardware="a100-80gb", stack="megatron-2021")
    assert rows and all(r["zero"] == 0 and r["cp"] == 1 and not r["sp"] and r["recompute"] != "selective"
                        and (r["pp"] == 1 or r["schedule"] in ("1f1b", "interleaved")) for r in rows)
    assert any(r["cp"] > 1 or r["zero"] > 0 for r in plan(GPT, gpus=16, global_batch=32, seq_len=2048,
                                                          hardware="a100-80gb"))


def test_each_further_micro_batch_adds_its_gradients_into_the_kept_ones() -> None:
    """autograd's += in the gradient's dtype (plait: 3 × 2 bytes a bf16 parameter; the first of
    the m micro-batches adds nothing), DeepSpeed's bf16 optimizer into fp32 (10, all m),
    Megatron-Core fused into the GEMM (0). The step's compute holds it."""
    layout = work("plait", grad_accum=4)
    stage = layout_stages(GPT, layout)[0]
    one = stage.params * 6 / (A100.memory_gb_s * 1e9)
    assert accumulate_s(layout, stage, A100) == pytest.approx(3 * one, rel=1e-12)
    # into the framework's own buffer: every micro-batch adds, the first too
    assert accumulate_s(replace(layout, stack="megatron-deepspeed"), stage, A100) == pytest.approx(4 * one * 10 / 6)
    assert accumulate_s(replace(layout, stack="megatron-core"), stage, A100) == 0.0
    assert accumulate_s(replace(layout, grad_accum=1), stage, A100) == 0.0
    sharded = replace(layout, dp=4, zero=2)  # ZeRO-2's hooks reduce-scatter each backward: the shard accumulates
    assert accumulate_s(sharded, stage, A100) == pytest.approx(3 * -(-stage.params // 4) * 6 / (A100.memory_gb_s * 1e9))
    four, one_mb = (estimate_time(GPT, replace(layout, grad_accum=m), A100, 8) for m in (4, 1))
    assert four.compute_s - 4 * one_mb.compute_s == pytest.approx(3 * one, rel=1e-9)


def test_transformer_engine_overlaps_tp_with_the_gemms_it_feeds() -> None:
    """`--stack nemo` (NeMo's ub_tp_comm_overlap): with sequence parallelism a block's
    all-gathers and reduce-scatters (6 and 4 a block; 8 and 5 with full recompute) are cut in
    tp pieces, moved while the GEMM works on the one before, so a micro-batch waits for the
    larger of their time / tp and what outlasts the blocks' GEMMs (the recomputed forward's
    included); the embedding's, head's, loss's and norms' collectives stay exposed. Without
    SP, and on megatron-core, it waits for all of it."""
    from plait.estimate.ops import block_gemm_s
    from plait.estimate.exposed import tp_s

    h100 = get_hardware("h100-sxm")
    latency, bandwidth = h100.link(8, 0)
    one = 7 * latency + 7 / 8 * (1 * 2048 * 1024 * 2) / bandwidth  # one collective of b·s·h bf16 over 8 ranks
    for recompute, per_block, again in (("selective", 10, 0), ("full", 13, 1)):
        layout = work("nemo", tp=8, sp=True, micro_batch=1, recompute=recompute)
        stage = layout_stages(GPT, layout)[0]
        whole = tp_s(GPT, replace(layout, stack="megatron-core"), stage, h100, 0, burst=0.0)
        blocks = stage.layers * per_block * one
        forward, backward = block_gemm_s(GPT, layout, replace(h100, op_overhead_us=0.0))
        gemms = stage.layers * ((1 + again) * forward + backward)
        expected = whole - blocks + max(blocks / 8, blocks - gemms)
        assert tp_s(GPT, layout, stage, h100, 0, burst=0.0) == pytest.approx(expected, rel=1e-12), recompute
        assert whole - blocks < expected < whole
        assert tp_s(GPT, replace(layout, sp=False), stage, h100, 0, burst=0.0) == pytest.approx(
            tp_s(GPT, replace(layout, sp=False, stack="megatron-core"), stage, h100, 0, burst=0.0), rel=1e-12)
        assert tp_s(GPT, layout, stage, h100, 2, burst=0.0) == tp_s(
            GPT, replace(layout, stack="megatron-core"), stage, h100, 2, burst=0.0)
    assert STACKS["nemo"].tp_overlap and not STACKS["megatron-core"].tp_overlap


def test_the_planner_prunes_on_nemo_as_it_ranks() -> None:
    """The planner's cached tp times follow the stack: on `--stack nemo` the pruned search
    ranks as the exhaustive one."""
    from plait.estimate.planner import plan_layouts, plan_request

    request = plan_request(GPT, gpus=16, global_batch=32, seq_len=2048, hardware="h100-sxm", stack="nemo")
    every = plan_layouts(request, exhaustive=True)
    assert any(row["tp"] > 1 and row["sp"] for row in every)
    assert plan_layouts(request, 5) == every[:5]
