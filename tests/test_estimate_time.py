"""FLOPs, link times, bubbles and MFU; hardware presets and TOML overrides."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.errors import PlaitError
from plait.estimate import estimate_layout
from plait.estimate.hardware import PRESETS, Hardware, get_hardware, load_hardware
from plait.estimate.layout import Workload, layout_stages
from plait.estimate.traffic import tp_collectives, tp_traffic
from plait.estimate.exposed import dp_exposed_s, gather_after_update_s, tp_s
from plait.estimate.network import collective_s, inter_node
from plait.estimate.time import estimate_time, flops_per_token, matmul_params, micro_batch_s_per_stage
from plait.models.gpt.config import GPTConfig, get_preset

H100 = get_hardware("h100-sxm")


def test_flops_per_token_six_psi_plus_attention() -> None:
    cfg = get_preset("llama-7b")
    psi = cfg.n_layers * cfg.layer_params() + cfg.vocab_size * cfg.d_model
    attn = 12 * cfg.n_layers * cfg.d_model * 4096
    assert matmul_params(cfg) == psi
    assert flops_per_token(cfg, 4096) == (6 * psi + attn, 6 * psi + attn)
    model, hardware = flops_per_token(cfg, 4096, "full")
    assert hardware - model == 2 * psi + attn / 3  # one more forward: 2Ψ + 4·L·h·s
    assert flops_per_token(cfg, 4096, "selective")[1] - model == attn / 3


def test_tied_head_counted_once() -> None:
    cfg = get_preset("tiny")  # tied: the table is the head's weight
    assert matmul_params(cfg) == cfg.num_params() - cfg.d_model  # everything but the final norm


def test_one_gpu_large_gemms_run_at_the_gemm_efficiency() -> None:
    """No communication, no bubble: a big GEMM is compute-bound at peak·compute_efficiency,
    and the whole step's MFU stays below that (attention, element-wise work, optimizer), though
    not far: a 1 B GPT ran eager at 37-41% MFU on an H100 and an H200 (RESULTS.md, GPU)."""
    from plait.estimate.ops import Gemm, gemm_s

    g = Gemm(8192, 8192, 8192)
    ramp = H100.gemm_fixed_us * 1e-6  # a product's ramp and tail (hardware.GEMM_RAMP_US): 1% of this one
    assert gemm_s(g, "bf16", H100) == pytest.approx(g.flops / (989e12 * H100.compute_efficiency) + ramp)
    assert 0 < ramp < 0.01 * gemm_s(g, "bf16", H100)
    step = estimate_time(get_preset("llama-1b"), Workload(precision="bf16", seq_len=2048, micro_batch=4), H100, 8)
    assert 0.4 * H100.compute_efficiency < step.mfu < H100.compute_efficiency


@pytest.mark.parametrize("schedule, v, slots", [("1f1b", 1, 3), ("gpipe", 1, 3), ("interleaved", 2, 1.5), ("zb-h1", 1, 1)])
def test_the_schedule_run_gives_the_textbook_bubble_when_the_head_sets_the_pace(schedule: str, v: int,
                                                                              slots: float) -> None:
    """llama-7b on 4 stages: the first three alike, the last (the head) the slowest. Running
    each schedule (plait.estimate.pipeline) leaves idle the other stages' fill and drain:
    (p-1) of their micro-batches for 1F1B and GPipe, (p-1)/v interleaved, (p-1)/3 for ZB-H1,
    whose deferred weight gradients fill the rest; at most the classical fraction
    slots / (m + slots) of the pipeline's time. The step's parts are its slowest path's
    (`critical_rank`): that rank's m micro-batches and its idle time add to the span."""
    cfg = get_preset("llama-7b")
    layout = Workload(pp=4, grad_accum=8, precision="bf16", seq_len=1024, schedule=schedule,
                    virtual_stages=v)
    step = estimate_time(cfg, layout, H100, 8)
    stages = micro_batch_s_per_stage(cfg, layout, H100, 8)
    others = [t for t in stages if t != max(stages)]
    span = 8 * stages[step.critical_rank] + step.bubble_s  # the schedule's end without its messages
    assert len(others) == 3 and span - 8 * max(stages) == pytest.approx(slots * sum(others) / 3)
    idle = span - 8 * max(stages)
    assert 0.9 * slots / (8 + slots) < idle / (span + step.pp_s) <= slots / (8 + slots)


def test_a_lopsided_cut_idles_less_than_its_slowest_stage_would() -> None:
    """--stage-layers 0,6: the first stage holds only the embedding, so filling and draining
    the pipeline costs almost nothing beyond the second stage's m micro-batches."""
    cfg = get_preset("small,n_layers=6")
    layout = Workload(pp=2, grad_accum=4, seq_len=128, micro_batch=4, stage_layers=(0, 6))
    first, second = micro_batch_s_per_stage(cfg, layout, H100, 8)
    step = estimate_time(cfg, layout, H100, 8)
    assert first < 0.05 * second and step.bubble_s == pytest.approx(first)


def test_collective_time_is_latency_plus_bandwidth() -> None:
    hw = Hardware("toy", 100, 10, 80, intra_node_gb_s=100, inter_node_gb_s=10,
                  intra_node_latency_us=5, inter_node_latency_us=20)
    assert collective_s("all_reduce", 1e9, 4, hw, False) == pytest.approx(6 * 5e-6 + 1.5e9 / 100e9)
    assert collective_s("all_gather", 1e9, 4, hw, True) == pytest.approx(3 * 20e-6 + 0.75e9 / 10e9)
    assert collective_s("send", 1e6, 2, hw, True) == pytest.approx(20e-6 + 1e6 / 10e9)


def test_which_axes_leave_the_node() -> None:
    """0 for a group inside one node, else how many of its ranks share each node (ranks
    numbered tp fastest, then cp, dp, pp): what NCCL's ring and tree latencies depend on."""
    def links(**degrees: int) -> dict[str, int]:
        found = inter_node(Workload(**degrees), 8)
        return {axis: found[axis] for axis in ("tp", "cp", "dp", "pp", "world")}

    assert links(dp=2, tp=4) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0, "world": 0}
    assert links(dp=4, tp=8, pp=2) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "world": 8}
    assert links(dp=1, tp=8, pp=4) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1, "world": 8}
    assert links(dp=8, tp=2, pp=2)["dp"] == 4  # dp ranks 2 apart: four of them in each node
    # cp ranks sit between tp and dp: cp 2 × tp 4 fills a node, so dp leaves it
    assert links(dp=2, cp=2, tp=4, seq_len=64) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0, "world": 8}  # pp 1: one rank
    # --dp-shard 4 with tp 2: a shard group is 8 neighbouring ranks, one node; its replicas span nodes
    hybrid = inter_node(Workload(dp=16, tp=2, zero=3, dp_shard=4), 8)
    assert (hybrid["dp_shard"], hybrid["dp_replicate"], hybrid["dp"]) == (0, 1, 4)
    assert inter_node(Workload(dp=16, tp=2, zero=3), 8)["dp_shard"] == 4  # plain ZeRO: all 32 ranks


def test_inter_node_dp_is_slower() -> None:
    cfg = get_preset("llama-7b")
    layout = Workload(dp=16, zero=1, precision="bf16", seq_len=4096)
    within = estimate_time(cfg, layout, H100, gpus_per_node=16)
    across = estimate_time(cfg, layout, H100, gpus_per_node=8)
    assert across.dp_s > within.dp_s
    assert across.compute_s == within.compute_s


def test_under_a_pipeline_zero_2_hides_its_reductions_behind_each_chunks_backward() -> None:
    """ZeRO-2 reduce-scatters inside each chunk's backward under a pipeline, as without one
    (tests/test_pipeline_worlds.py reads its events), so a GPU hides each micro-batch's
    reductions behind its backward but the last bucket of every chunk, less the share of its
    backward each chunk runs before its first bucket is full (the flow shop's fill: v / B of
    the backward); ZeRO-1 reduces once, after the schedule, behind nothing; a CPU, which
    overlaps nothing, waits for them all."""
    params, compute, m, v = 2_000_000_000, 0.12, 8, 2
    layout = Workload(dp=32, pp=2, virtual_stages=v, schedule="interleaved", zero=2, precision="bf16", grad_accum=m,
                      seq_len=4096)
    grads, bucket = params * 2, layout.bucket_bytes
    reduce_all = collective_s("reduce_scatter", grads, 32, H100, 1, grads / bucket)
    last = collective_s("reduce_scatter", bucket, 32, H100, 1)
    gather = collective_s("all_gather", grads, 32, H100, 1, grads / bucket)
    hidden = dp_exposed_s(params, 0, layout, H100, 1, compute, 1 / 3) + gather_after_update_s(params, layout, H100, 1)
    fill = v / (grads / bucket)
    assert hidden == pytest.approx(m * max(v * last, reduce_all - compute * 2 / 3 * (1 - fill)) + gather)
    assert reduce_all > compute * 2 / 3 > v * last  # the window hides part, more than a bucket a chunk
    cpu = replace(H100, queues_kernels=False)
    assert dp_exposed_s(params, 0, layout, cpu, 1, compute, 1 / 3) == pytest.approx(m * reduce_all)
    assert gather_after_update_s(params, layout, cpu, 1) == pytest.approx(gather)
    zero1 = layout.replace(zero=1)
    assert dp_exposed_s(params, 0, zero1, H100, 1, compute, 1 / 3) == pytest.approx(reduce_all)
    assert gather_after_update_s(params, zero1, H100, 1) == pytest.approx(gather)


def test_a_bucket_starts_its_collective_once_its_share_of_backward_has_run() -> None:
    """Data parallelism's reduction hides behind backward but for the last bucket, and for the
    share of backward that runs before the first bucket is full: B buckets of C behind T expose
    max(C/B, C - T + T/B), a two-stage flow shop. Megatron-Core sizes its buckets by the dp
    ranks (max(40 M, 1 M · dp) parameters), so the fill grows with dp: Nemotron-4 15B's ZeRO-1
    step (tp 8, micro-batch 1 of 4,096 tokens, 4 a step) was priced flat from 768 to 2,304
    H100s where the paper's MFU falls 11% (34.3, 33.3, 30.5); the fill adds 4.6, 9.3 and 13.9 ms,
    and the row at 2,304 GPUs comes within 10% (1.12 before)."""
    params, compute = 2_000_000_000, 0.05
    layout = Workload(dp=64, zero=1, precision="bf16", seq_len=4096, stack="megatron-core", reduce_dtype="fp32")
    buckets = params * 2 / layout.bucket_bytes
    reduce_all = collective_s("reduce_scatter", params * 4, 64, H100, 8, buckets)
    last = collective_s("reduce_scatter", layout.bucket_bytes * 2, 64, H100, 8)
    gather = collective_s("all_gather", params * 2, 64, H100, 8, buckets)
    first = collective_s("all_gather", layout.bucket_bytes, 64, H100, 8)
    exposed = dp_exposed_s(params, 0, layout, H100, 8, compute, 1 / 3)
    backward, forward = compute * 2 / 3, compute / 3
    assert exposed == pytest.approx(max(last, reduce_all - backward * (1 - 1 / buckets))
                                    + max(first, gather - forward * (1 - 1 / buckets)))
    assert reduce_all > backward and gather > forward  # each window hides part: the fill is exposed
    assert exposed - (max(last, reduce_all - backward) + max(first, gather - forward)) == pytest.approx(compute / buckets)


def test_offload_costs_pcie_and_host_time() -> None:
    cfg = get_preset("llama-7b")
    base = estimate_layout(cfg, dp=8, zero=2, precision="bf16", seq_len=1024, hardware="h100-sxm")
    off = estimate_layout(cfg, dp=8, zero=2, offload=True, precision="bf16", seq_len=1024,
                          hardware="h100-sxm")
    assert off["time"]["offload_s"] > 0 == base["time"]["offload_s"]
    assert off["time"]["step_s"] > base["time"]["step_s"]


def test_report_is_json_ready() -> None:
    import json

    result = estimate_layout(get_preset("llama-7b"), dp=2, tp=2, pp=2, zero=1, sp=True,
                             grad_accum=4, precision="bf16", seq_len=1024, hardware="a100-80gb")
    assert json.loads(json.dumps(result))["time"]["step_s"] == result["time"]["step_s"]
    assert {"params", "grads", "optim", "activations", "buffers", "total"} <= set(result["memory"])
    assert {"step_s", "tokens_per_s", "mfu", "flops_per_token"} <= set(result["time"])
    assert all(isinstance(line, str) for line in result["assumptions"])


# -- hardware ------------------------------------------------------------------------------
def test_presets() -> None:
    wanted = {"v100", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "rtx3090",
              "rtx4090", "cpu"}
    assert wanted <= set(PRESETS)
    assert get_hardware("h100-sxm").peak_flops("bf16") == 989e12
    assert get_hardware("a100-80gb").peak_flops("fp32") == 19.5e12
    assert get_hardware("cpu").peak_fp32_tflops > get_hardware("cpu").peak_bf16_tflops > 0


def test_unknown_hardware_lists_the_presets() -> None:
    with pytest.raises(PlaitError) as err:
        get_hardware("tpu-v9")
    assert "unknown hardware 'tpu-v9'" in err.value.message
    assert "h100-sxm" in err.value.hint


def test_toml_override(tmp_path) -> None:
    path = tmp_path / "my.toml"
    path.write_text('[hardware]\nbase = "h100-sxm"\nname = "h100-slow-ib"\ninter_node_gb_s = 12.5\n')
    hw = load_hardware(path)
    assert (hw.name, hw.inter_node_gb_s, hw.peak_bf16_tflops) == ("h100-slow-ib", 12.5, 989.0)
    result = estimate_layout(get_preset("llama-7b"), dp=16, zero=1, precision="bf16", seq_len=1024,
                             hardware=hw, gpus_per_node=8)
    assert result["layout"]["hardware"] == "h100-slow-ib"


def test_toml_full_table_and_errors(tmp_path) -> None:
    full = tmp_path / "full.toml"
    full.write_text('[hardware]\nname = "mine"\npeak_bf16_tflops = 100\npeak_fp32_tflops = 10\n'
                    'memory_gib = 16\nintra_node_gb_s = 50\ninter_node_gb_s = 5\n')
    assert load_hardware(full).memory_gib == 16
    bad = tmp_path / "bad.toml"
    bad.write_text('[hardware]\nbase = "h100-sxm"\nflops = 3\n')
    with pytest.raises(PlaitError, match="unknown \\[hardware\\] keys: flops"):
        load_hardware(bad)
    partial = tmp_path / "partial.toml"
    partial.write_text('[hardware]\nname = "x"\nmemory_gib = 16\n')
    with pytest.raises(PlaitError, match="lacks inter_node_gb_s"):
        load_hardware(partial)
    negative = tmp_path / "neg.toml"
    negative.write_text('[hardware]\nbase = "cpu"\nmemory_gib = -1\n')
    with pytest.raises(PlaitError, match="memory_gib must be a positive number"):
        load_hardware(negative)
    with pytest.raises(PlaitError, match="has no \\[hardware\\] table"):
        (tmp_path / "empty.toml").write_text("")
        load_hardware(tmp_path / "empty.toml")
    with pytest.raises(PlaitError, match="cannot read hardware file"):
        load_hardware(tmp_path / "missing.toml")


def test_collectives_across_nodes_are_priced_as_nccl_prices_them() -> None:
    """A ring pays the network's latency only where it crosses nodes; an all-reduce takes the
    double binary tree when that is faster (NCCL's tuning model, src/graph/tuning.cc). A
    group with k ranks in each node crosses on k NICs at once (a ring channel per NIC:
    busBw = nChannels · bwInter), up to the node's own links; an all-to-all does not
    aggregate NICs."""
    h100 = get_hardware("h100-sxm")
    near, far, nic = 3e-6, 8e-6, 50e9
    eight = 8 * nic  # 8 ranks a node: the node's 8 NICs, 400 GB/s (under NVLink's 450)
    # 16 ranks, 8 a node: one of the all-gather's 15 steps crosses the network (N - 1 = 1)
    wire = 15 / 16 * 64e6 / eight
    assert collective_s("all_gather", 64e6, 16, h100, 8) == pytest.approx(14 * near + 1 * far + wire)
    # a large all-reduce over 16 ranks on 2 nodes: the ring (its latency is small beside the tree's bandwidth)
    wire = 2 * 15 / 16 * 1e9 / eight
    assert collective_s("all_reduce", 1e9, 16, h100, 8) == pytest.approx(2 * (14 * near + 1 * far) + wire)
    # 8 bytes over 2,304 GPUs (288 nodes): the tree, 2·(7·near + ⌊log2 288⌋ = 8·far), 2S at 0.9
    tree = 2 * (7 * near + 8 * far) + 2 * 8 / (0.9 * eight)
    assert collective_s("all_reduce", 8, 2304, h100, 8) == pytest.approx(tree)
    assert collective_s("all_reduce", 8, 2304, h100, 8) < 2 * 2303 * far / 100  # not 4,606 network steps
    # one rank a node (True): every ring step crosses, on that rank's own NIC
    assert collective_s("reduce_scatter", 1e6, 4, h100, True) == pytest.approx(3 * far + 3 / 4 * 1e6 / nic)
    # 2 ranks a node: two NICs; an all-to-all over the same ranks: its own NIC alone
    assert collective_s("all_gather", 1e9, 8, h100, 2) == pytest.approx(4 * near + 3 * far + 7 / 8 * 1e9 / (2 * nic))
    assert collective_s("all_to_all", 1e9, 8, h100, 2) == pytest.approx(7 * far + 7 / 8 * 1e9 / nic)
    # NVIDIA's figure for DGX A100 (8 HDR NICs a node, NVIDIA/nccl#812): 192 GB/s of all-reduce
    # bus bandwidth across nodes; the preset's 8 x 25 GB/s is that within 5%
    a100 = get_hardware("a100-80gb")
    seconds = collective_s("all_reduce", 8e9, 64, a100, 8) - 2 * (56 * a100.latency(False) + 7 * a100.latency(True))
    assert 2 * 63 / 64 * 8e9 / seconds == pytest.approx(192e9, rel=0.05)
    # never past the node's own links: 8 NICs of 50 GB/s against an intra-node link of 300
    slow_nvlink = replace(h100, intra_node_gb_s=300.0)
    assert collective_s("all_gather", 1e9, 16, slow_nvlink, 8) == pytest.approx(14 * near + far + 15 / 16 * 1e9 / 300e9)


def test_tensor_parallelism_across_nodes_is_priced_as_any_ring() -> None:
    """tp 16 over two 8-GPU nodes: its all-gathers and reduce-scatters cost what collective_s
    charges those collectives (the network's latency where a step crosses, the bytes on the
    node's eight NICs), not every step at the network's latency on one NIC."""
    config = get_preset("llama-7b")
    layout = Workload(dp=1, tp=16, sp=True, precision="bf16", micro_batch=1, seq_len=4096)
    stage = layout_stages(config, layout)[0]
    counts = tp_collectives(layout, stage)
    act = layout.hidden_bytes(config.d_model)
    expected = sum(collective_s(op, act * count, 16, H100, 8, count) for op, count in counts.items())
    expected += tp_traffic(config, layout, stage)["tp"]["all_reduce"] / (8 * 50e9)  # the loss's sums: bytes only
    assert set(counts) == {"all_gather", "reduce_scatter"}
    assert tp_s(config, layout, stage, H100, 8, burst=0.0) == pytest.approx(expected)
    one_nic = sum(count * 15 * 8e-6 + count * 15 / 16 * act / 50e9 for count in counts.values())
    assert tp_s(config, layout, stage, H100, 8, burst=0.0) < one_nic / 4


def test_the_estimate_follows_the_runs_gradient_buckets() -> None:
    """--bucket-mb: one collective per bucket, so larger buckets pay fewer latencies (a
    Megatron-Core run's max(40 M, 1 M x dp) parameters, not plait's 25 MiB); zero refused."""
    config, hw = get_preset("llama-7b"), get_hardware("h100-sxm")
    base = Workload(dp=64, zero=1, precision="bf16", micro_batch=1, grad_accum=4, seq_len=2048)
    small, large = (estimate_time(config, base.replace(bucket_mb=mb), hw, 8) for mb in (25.0, 400.0))
    assert large.dp_s < small.dp_s and large.compute_s == small.compute_s
    with pytest.raises(PlaitError, match="--bucket-mb must be a positive number"):
        base.replace(bucket_mb=0)


@pytest.mark.parametrize("sp, recompute, measured", [
    (False, "none", {"all_reduce": 213_760}),
    (False, "full", {"all_reduce": 295_680}),
    (True, "none", {"all_reduce": 100_608, "reduce_scatter": 24_576, "all_gather": 49_152}),
    (True, "full", {"all_reduce": 166_144, "reduce_scatter": 32_768, "all_gather": 65_536}),
], ids=["tp", "tp_full", "tp_sp", "tp_sp_full"])
def test_experts_a_tp_plan_splits_are_priced_as_they_run(sp: bool, recompute: str, measured: dict) -> None:
    """Llama 4's shape (two MoE blocks, four experts each run on every token, one shared expert,
    its plan splitting them by tp): the tp bytes of one step as `plait train --tp 2` measured
    them on 2 ranks (micro-batch 2 x 32 tokens, fp32; the clip's 8 bytes aside). Full recompute
    reruns the routed experts' exit, not the shared expert's; under SP the MoE block runs whole
    on the gathered sequence."""
    config = GPTConfig(vocab_size=256, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, experts=4,
                       top_k=1, shared_experts=1, expert_hidden=64, tp_expert_rows=4, whole_sequence_ends=True,
                       lean_blocks=False)
    layout = Workload(dp=1, tp=2, sp=sp, micro_batch=2, seq_len=32, recompute=recompute)
    traffic = [tp_traffic(config, layout, stage)["tp"] for stage in layout_stages(config, layout)]
    assert traffic == [measured]
    whole = replace(config, tp_expert_rows=0)  # priced as kept whole on every tp rank, it would differ
    assert tp_traffic(whole, layout, layout_stages(whole, layout)[0])["tp"] != measured


def test_an_moe_blocks_gemms_are_its_active_experts() -> None:
    """An MoE block's GEMMs do the FLOPs its active parameters say, 2 a weight a token: the
    router, top_k routed experts (as rows of one grouped GEMM, expert_hidden wide) and the
    shared ones, not a dense MLP of ffn_hidden (Mixtral's experts are as wide as its
    ffn_hidden: half its MLP's work was missing). A model that runs every expert on every
    token (Llama 4, tp_expert_rows) does E experts' work a token, split by tp as its plan splits
    them; without ep and tp it is one rank's whole block."""
    from plait.estimate.ops import block_gemms

    tokens, h = 64, 32
    mixtral = GPTConfig(vocab_size=256, n_layers=2, d_model=h, n_heads=4, n_kv_heads=2, ffn_hidden=64, experts=4,
                        top_k=2, expert_hidden=64, shared_experts=1, shared_expert_gate=True)
    norms_and_gate = 2 * h + h
    flops = sum(g.flops for g in block_gemms(mixtral, tokens, 1, moe=True))
    assert flops == 2 * tokens * (mixtral.active_block_params(0) - norms_and_gate)
    assert sum(g.flops for g in block_gemms(mixtral, tokens, 2, moe=True)) > flops / 2  # experts whole on each tp rank
    llama4 = replace(mixtral, top_k=1, shared_expert_gate=False, tp_expert_rows=4)
    every = sum(g.flops for g in block_gemms(llama4, tokens, 1, moe=True))
    assert every == 2 * tokens * (llama4.active_block_params(0) - 2 * h + 3 * llama4.expert_params())
    router = 2 * tokens * h * llama4.experts  # whole on every tp rank; attention and experts split
    assert sum(g.flops for g in block_gemms(llama4, tokens, 2, moe=True)) == (every - router) / 2 + router


@pytest.mark.parametrize("tp", [1, 2])
def test_an_moe_blocks_elementwise_work_runs_over_its_experts_rows(tp: int) -> None:
    """Mixtral's token makes two expert rows, each ffn_hidden wide, whole on every tp rank: its
    MLP's element-wise bytes are twice a dense block's of that width (split by tp there). They
    were priced as one dense MLP's, split by tp."""
    from plait.estimate.ops import activation_op_bytes, dtype_bytes, elementwise_counts, elementwise_s

    moe = get_preset("mixtral-8x7b")
    dense = replace(moe, experts=0)
    layout = Workload(tp=tp, micro_batch=1, seq_len=4096, precision="bf16", zero=1)
    hw = get_hardware("h100-sxm")
    for backward in (False, True):
        c = elementwise_counts(moe, layout)[backward][3]
        tokens = layout.tokens_per_micro_batch
        rate = hw.memory_rate(activation_op_bytes(moe.d_model, tokens, tp, False, "bf16"))
        extra = c * (2 * moe.ffn_hidden - moe.ffn_hidden / tp) * tokens * dtype_bytes("bf16") / rate
        gap = elementwise_s(moe, layout, hw, 1, False, backward) - elementwise_s(dense, layout, hw, 1, False, backward)
        assert gap == pytest.approx(extra, rel=1e-9)


def test_gathered_projections_pay_a_latency_each() -> None:
    """A plan that gathers fused projections whole (Phi-3's q|k|v and gate|up: two gathered
    outputs forward, two split inputs' gradients backward) runs an all-gather for each: the
    tp seconds grow by their latencies, not only their bytes; again in full recompute's rerun;
    under SP as without it (inside the region the sequence's gather entered, the layers gather
    as they do without SP: Phi-3's SP case of the sweep is priced so)."""
    from plait.estimate.exposed import stage_tp_collectives
    from plait.estimate.traffic import gathered_calls

    base = get_preset("small")
    gathered = replace(base, tp_gathered=(3 * base.d_model, 2 * base.ffn_hidden), tp_gathered_calls=(2, 2))
    hw = get_hardware("h100-sxm")
    for recompute, per_layer in (("none", 4), ("full", 6)):
        layout = Workload(tp=2, micro_batch=2, seq_len=128, recompute=recompute)
        stage = layout_stages(base, layout)[0]
        assert gathered_calls(gathered, layout, stage) == per_layer * base.n_layers
        plain, with_gathers = (stage_tp_collectives(c, layout, stage) for c in (base, gathered))
        assert with_gathers["all_gather"] - plain.get("all_gather", 0) == per_layer * base.n_layers
        latency = per_layer * base.n_layers * hw.link(2, False)[0]  # one ring step each on 2 ranks
        bytes_only = replace(gathered, tp_gathered_calls=(0, 0))
        gathered_s, bytes_only_s = (tp_s(c, layout, stage, hw, 0, burst=0.0) for c in (gathered, bytes_only))
        assert gathered_s - bytes_only_s == pytest.approx(latency)
    sp = Workload(tp=2, sp=True, micro_batch=2, seq_len=128)
    assert gathered_calls(gathered, sp, layout_stages(base, sp)[0]) == 4 * base.n_layers


def test_fp8_runs_in_float8_only_the_products_it_converts() -> None:
    """fp8 converts plain linears whose weights fit the float8 tile: an MoE block's attention and
    shared experts, not its routed experts (grouped weights) nor a router of 8 experts, nor the
    head. Those are priced, and calibrated, in bf16."""
    from plait.estimate.ops import block_gemm_s, block_gemms, gemm_precision, gemm_s, head_gemm

    moe = replace(get_preset("mixtral-8x7b"), shared_experts=1)
    gemms = block_gemms(moe, 4096, 1, moe=True)
    assert [gemm_precision(g, "fp8") for g in gemms] == ["fp8"] * 4 + ["bf16"] * 4 + ["fp8"] * 3
    assert gemm_precision(head_gemm(moe, 4096, 1), "fp8") == "bf16"
    assert gemm_precision(block_gemms(replace(moe, d_model=4104, n_heads=36, n_kv_heads=36), 4096, 1)[0],
                          "fp8") == "bf16"  # off the tile
    hw = get_hardware("h100-sxm")
    layout = Workload(precision="fp8", zero=1, micro_batch=1, seq_len=4096)
    forward, _ = block_gemm_s(moe, layout, hw, moe=True)
    by_dtype = sum(gemm_s(g, "fp8" if i < 4 or i > 7 else "bf16", hw) for i, g in enumerate(gemms))
    assert forward == pytest.approx(by_dtype)
    assert forward > sum(gemm_s(replace(g, float8=True), "fp8", hw) for g in gemms)
