"""The GPU presets against published training throughput: arithmetic only, no GPU needed.

Rows: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21), Table 1 — GPT models, 1.7 B to 1 T parameters, weak scaling on
DGX A100 80 GB nodes (8 GPUs, NVLink, 8 × 200 Gb/s HDR InfiniBand), mixed precision, full
activation recomputation, sequence 2048, vocabulary 51 200; their TFLOP/s per GPU counts the
recomputed forward. And torchtitan's Llama 3.1 8B FSDP runs on H100 (benchmarks/
llama3_h100_202412_torchtitan.md in pytorch/torchtitan: local batch 2, sequence 8192,
selective activation checkpointing, bf16, no torch.compile, no Float8).

Also every bf16 row of llm-foundry's MPT benchmark table (benchmarks/published/llm_foundry_mpt.csv),
summarised per GPU, and each of its rows outside 10% with its reason (llm_foundry_reasons).

What the papers do not state, assumed here and the same for every row: micro-batch 1 and the
plain 1F1B schedule for Megatron; FSDP as ZeRO-3 with prefetch for torchtitan. Nothing is fitted
per row: every number comes from the presets in plait/estimate/hardware.py. The factors per GPU
that llm_foundry_reasons fits over llm-foundry's rows diagnose the rows outside 10%; no
prediction reads them.

    python benchmarks/gpu_presets.py            # prints the Markdown tables
    python benchmarks/gpu_presets.py --write    # and replaces its section of RESULTS.md
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plait.estimate.context import forward_passes  # noqa: E402
from plait.estimate.hardware import get_hardware  # noqa: E402
from plait.estimate.layout import Workload  # noqa: E402
from plait.estimate.memory import estimate_memory, state_bytes  # noqa: E402
from plait.estimate.network import collective_s, inter_node  # noqa: E402
from plait.estimate.ops import attention_time, gemm_s, head_gemm, stage_gemm_s  # noqa: E402
from plait.estimate.time import estimate_time, flops_per_token  # noqa: E402
from plait.estimate.traffic import zero3_gathers  # noqa: E402
from plait.models.gpt.config import GPTConfig  # noqa: E402

# (billions of params, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU, % of peak)
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)
# Table 2 of the same paper, GPT-3 175 B (96 layers, hidden 12288, 96 heads), global batch 1536:
# (GPUs, published TFLOP/s per GPU) for PTD-P at t 8, p 12, and ZeRO-3 without model parallelism
# (micro-batch 4, 2, 1), whose collapse with scale is the point.
NARAYANAN_TABLE_2_PTDP = ((384, 153), (768, 149), (1536, 141))
NARAYANAN_TABLE_2_ZERO3 = ((384, 4, 144), (768, 2, 88), (1536, 1, 44))
GPT3_175B = GPTConfig(vocab_size=51200, n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, ffn_hidden=4 * 12288,
                      max_seq_len=2048, arch="gpt2")
# (GPUs, tokens per second per GPU), FSDP without torch.compile
TORCHTITAN_LLAMA3_8B = ((8, 5762), (128, 5605))
LLAMA3_8B = GPTConfig(vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                      ffn_hidden=14336, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0)


def megatron_rows() -> list[tuple]:
    """(params B, t, p, GPUs, published TFLOP/s, predicted TFLOP/s) per row of Table 1."""
    hw, out = get_hardware("a100-80gb"), []
    for size, heads, h, layers, t, p, gpus, batch, published, _ in NARAYANAN_TABLE_1:
        config = GPTConfig(vocab_size=51200, n_layers=layers, d_model=h, n_heads=heads, n_kv_heads=heads,
                           ffn_hidden=4 * h, max_seq_len=2048, arch="gpt2")
        dp = gpus // (t * p)
        layout = Workload(dp=dp, tp=t, pp=p, precision="bf16", micro_batch=1, grad_accum=batch // dp,
                        seq_len=2048, recompute="full", schedule="1f1b", stack="megatron-2021")
        step = estimate_time(config, layout, hw, 8)
        out.append((size, t, p, gpus, published, step.hardware_flops_per_token * step.tokens_per_s / gpus / 1e12))
    return out


def table_2_rows() -> list[tuple]:
    """(layout, GPUs, published TFLOP/s, predicted TFLOP/s) of Table 2: PTD-P as the interleaved
    schedule with 2 chunks a rank and micro-batch 1 (assumed: the table gives t and p), and
    ZeRO-3 over every GPU with its micro-batches; full recompute, as the paper's runs."""
    hw, out = get_hardware("a100-80gb"), []
    for gpus, published in NARAYANAN_TABLE_2_PTDP:
        dp = gpus // 96
        layout = Workload(dp=dp, tp=8, pp=12, precision="bf16", micro_batch=1, grad_accum=1536 // dp, seq_len=2048,
                          recompute="full", schedule="interleaved", virtual_stages=2,
                          stack="megatron-2021")
        out.append(("t 8, p 12 (interleaved)", gpus, published, _tflops(layout, hw, gpus)))
    for gpus, micro, published in NARAYANAN_TABLE_2_ZERO3:
        layout = Workload(dp=gpus, zero=3, precision="bf16", micro_batch=micro, grad_accum=1536 // gpus // micro,
                          seq_len=2048, recompute="full")
        out.append((f"ZeRO-3, micro-batch {micro}", gpus, published, _tflops(layout, hw, gpus)))
    return out


def _tflops(layout: Workload, hw: object, gpus: int) -> float:
    """Hardware TFLOP/s per GPU (the recomputed forward counted, as the paper counts)."""
    step = estimate_time(GPT3_175B, layout, hw, 8)
    return step.hardware_flops_per_token * step.tokens_per_s / gpus / 1e12


def torchtitan_rows() -> list[tuple]:
    """(preset, GPUs, published TPS/GPU, predicted TPS/GPU, predicted MFU of 989 TFLOP/s)."""
    sxm = get_hardware("h100-sxm")
    # Their GPUs: H100 SXM boards with 96 GB HBM2e at 2.4 TB/s, capped at 500 W; peak unknown,
    # "between SXM and NVL": H100 PCIe's 756 TFLOP/s datasheet figure stands in for it.
    capped = replace(sxm, name="h100 500 W (756 TFLOP/s, 2.4 TB/s)", peak_bf16_tflops=756.0, memory_gb_s=2400.0)
    out = []
    for hw in (sxm, capped):
        for gpus, published in TORCHTITAN_LLAMA3_8B:
            layout = Workload(dp=gpus, zero=3, precision="bf16", micro_batch=2, seq_len=8192, recompute="selective")
            step = estimate_time(LLAMA3_8B, layout, hw, 8)
            mfu = step.flops_per_token * step.tokens_per_s / gpus / 989e12
            out.append((hw.name, gpus, published, step.tokens_per_s / gpus, mfu))
    return out


# More published runs, each with its own definition of the figure: "hfu" counts the recomputed
# forward (Megatron's Eq. 3; BLOOM's logs), "mfu" counts only the model's 6Ψ + 12·L·h·s (PaLM,
# llm-foundry, Nemotron), each against the GPU's dense 16-bit peak (A100 312, H100 989 TFLOP/s).
def _mpt(d_model: int, layers: int, heads: int) -> GPTConfig:
    """llm-foundry's MPT: GELU MLP of 4·d (two matrices), no biases, tied head, vocabulary 50 368."""
    return GPTConfig(vocab_size=50368, n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=heads,
                     ffn_hidden=4 * d_model, max_seq_len=2048, mlp_matrices=2, tie_embeddings=True)


BLOOM_176B = GPTConfig(vocab_size=250880, n_layers=70, d_model=14336, n_heads=112, n_kv_heads=112,
                       ffn_hidden=4 * 14336, max_seq_len=2048, arch="gpt2", tie_embeddings=True)
NEMOTRON_4_15B = GPTConfig(vocab_size=256000, n_layers=32, d_model=6144, n_heads=48, n_kv_heads=8, ffn_hidden=24576,
                           max_seq_len=4096, mlp_matrices=2, tie_embeddings=False)
# Llama 3 405B (arXiv 2407.21783, Table 4): tp 8, cp 1, pp 16, dp 64 or 128 on 8,192 or 16,384
# H100s, 8,192-token sequences, 16 M tokens a step (2,048 sequences), bf16 MFU 43% and 41%. The
# paper gives the cut and so the chunks (section 3.3.2): "we reduce one Transformer layer each
# from the first and the last stages ... the first model chunk on the first stage has only the
# embedding, and the last model chunk on the last stage has only output projection and loss".
# A chunk of one layer less holds none: chunks of one layer, 126 + 2 = 16 x 8, so interleaved x8
# (LLAMA3_405B_CUT). Its FSDP "shards optimizer states and gradients", not the weights after
# forward (section 3.3.2), without saying whether the gradients are reduce-scattered every
# micro-batch (plait's ZeRO-2: 16-32 reduce-scatters a step) or once a step, held whole until
# then (in memory as ZeRO-1 holds them): assumed ZeRO-1. It names no recomputation ("without
# activation checkpointing" at 8 K tokens): assumed none.
LLAMA3_405B = GPTConfig(vocab_size=128256, n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8,
                        ffn_hidden=53248, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0)
LLAMA3_405B_CUT = (0,) + (1,) * 126 + (0,)


def megatron_bucket_mb(dp: int) -> float:
    """Megatron-Core's default gradient bucket, max(40 M, 1 M x dp) parameters (DDPConfig.bucket_size:
    "larger DP sizes need larger buckets to ensure collectives do not become latency-bound"), as
    plait's --bucket-mb: MiB of the bucket's gradients in their own dtype, bf16. Megatron reduces
    them in fp32 under bf16 (accumulate_allreduce_grads_in_fp32): the rows say --reduce-dtype fp32."""
    return max(40_000_000, 1_000_000 * dp) * 2 / 2**20


# Machines of published runs that no preset describes, each a preset with what its source says
# differs. BLOOM's Jean Zay nodes had 8 A100 80GB and "4 OmniPath links" (100 Gb/s each, the
# BLOOM paper, arXiv 2211.05100, section 3.4.1; tr11's README): 50 GB/s a node, 6.25 a GPU's
# share, where a DGX A100 has a 200 Gb/s HDR NIC a GPU.
MACHINES = {"a100-80gb jean-zay": replace(get_hardware("a100-80gb"), name="a100-80gb jean-zay", inter_node_gb_s=6.25)}


def machine(name: str) -> object:
    """A published run's machine: a stand-in of MACHINES, else the preset of that name."""
    return MACHINES.get(name) or get_hardware(name)


# (source, model, hardware, GPUs, layout, figure kind, published %, or TFLOP/s for "hfu-tflops")
PUBLISHED = (
    ("BLOOM tr11 (bigscience): tp 4, pp 12, dp 8, ZeRO-1, micro 2, batch 2048, full recompute, "
     "--stack megatron-deepspeed", BLOOM_176B,
     "a100-80gb jean-zay", 384, Workload(dp=8, tp=4, pp=12, zero=1, precision="bf16", micro_batch=2, grad_accum=128,
                                seq_len=2048, recompute="full", stack="megatron-deepspeed"), "hfu-tflops", 149.8),
    ("llm-foundry MPT-7B: FSDP full shard, micro 6, batch 48, no recompute, fp32 reduce", _mpt(4096, 32, 32), "h100-sxm", 8,
     Workload(dp=8, zero=3, precision="bf16", micro_batch=6, grad_accum=1, seq_len=2048, stack="llm-foundry",
              reduce_dtype="fp32"), "mfu", 46.44),
    ("llm-foundry MPT-30B: FSDP full shard, micro 14, batch 1344, full recompute, fp32 reduce", _mpt(7168, 48, 56), "h100-sxm", 32,
     Workload(dp=32, zero=3, precision="bf16", micro_batch=14, grad_accum=3, seq_len=2048, recompute="full",
              stack="llm-foundry", reduce_dtype="fp32"), "mfu", 43.92),
    ("llm-foundry MPT-70B: FSDP full shard, micro 8, batch 2048, full recompute, fp32 reduce", _mpt(8192, 80, 64),
     "h100-sxm", 64,
     Workload(dp=64, zero=3, precision="bf16", micro_batch=8, grad_accum=4, seq_len=2048, recompute="full",
              stack="llm-foundry", reduce_dtype="fp32"), "mfu", 42.57),
    ("llm-foundry MPT-70B: FSDP full shard, micro 8, batch 2048, full recompute", _mpt(8192, 80, 64), "a100-80gb",
     64, Workload(dp=64, zero=3, precision="bf16", micro_batch=8, grad_accum=4, seq_len=2048, recompute="full",
                  stack="llm-foundry"), "mfu", 53.33),
    *((f"Nemotron-4 15B (arXiv 2402.16819): tp 8 + sp, dp {dp}, batch {4 * dp}, micro 1, ZeRO-1 (assumed), "
       f"selective recompute (assumed), Megatron-Core's buckets, fp32 reduce, --stack nemo", NEMOTRON_4_15B,
       "h100-sxm", 8 * dp,
       Workload(dp=dp, tp=8, sp=True, zero=1, precision="bf16", micro_batch=1, grad_accum=4, seq_len=4096,
                recompute="selective", bucket_mb=megatron_bucket_mb(dp), reduce_dtype="fp32", stack="nemo"),
       "mfu", published)
      for dp, published in ((96, 34.3), (192, 33.3), (288, 30.5))),
    *((f"Llama 3 405B (arXiv 2407.21783): tp 8 + sp, pp 16 interleaved x8, a layer a chunk, the first "
       f"and last chunk none, dp {dp}, batch 2048, micro 1, ZeRO-1 (assumed), no recompute (assumed)", LLAMA3_405B, "h100-sxm", 128 * dp,
       Workload(dp=dp, tp=8, pp=16, sp=True, zero=1, precision="bf16", micro_batch=1, grad_accum=2048 // dp,
                seq_len=8192, schedule="interleaved", virtual_stages=8, stage_layers=LLAMA3_405B_CUT), "mfu", published)
      for dp, published in ((64, 43.0), (128, 41.0))),
)


def published_rows() -> list[tuple]:
    """(source, hardware, GPUs, kind, published, predicted) for PUBLISHED: the prediction in the
    row's own definition (a percentage of the dense 16-bit peak, or hardware TFLOP/s per GPU)."""
    out = []
    for source, config, hardware, gpus, layout, kind, published in PUBLISHED:
        assert layout.world == gpus, source
        step = estimate_time(config, layout, machine(hardware), 8)
        predicted = (step.hardware_flops_per_token * step.tokens_per_s / gpus / 1e12 if kind == "hfu-tflops"
                     else 100 * step.mfu)
        out.append((source, hardware, gpus, kind, published, predicted))
    return out


def published_layouts() -> list[tuple[str, GPTConfig, str, Workload]]:
    """(run, model, hardware preset, the published layout) of every run above with a layout:
    Table 1's, Table 2's PTD-P ones, and PUBLISHED."""
    out = []
    for size, heads, h, layers, t, p, gpus, batch, _, _ in NARAYANAN_TABLE_1:
        config = GPTConfig(vocab_size=51200, n_layers=layers, d_model=h, n_heads=heads, n_kv_heads=heads,
                           ffn_hidden=4 * h, max_seq_len=2048, arch="gpt2")
        dp = gpus // (t * p)
        out.append((f"Narayanan Table 1, {size} B", config, "a100-80gb",
                    Workload(dp=dp, tp=t, pp=p, precision="bf16", micro_batch=1, grad_accum=batch // dp, seq_len=2048,
                             recompute="full", schedule="1f1b", stack="megatron-2021")))
    for gpus, _ in NARAYANAN_TABLE_2_PTDP:
        dp = gpus // 96
        out.append((f"Narayanan Table 2, 175 B, {gpus} GPUs", GPT3_175B, "a100-80gb",
                    Workload(dp=dp, tp=8, pp=12, precision="bf16", micro_batch=1, grad_accum=1536 // dp, seq_len=2048,
                             recompute="full", schedule="interleaved", virtual_stages=2,
                          stack="megatron-2021")))
    out += [(source.split(":")[0], config, hardware, layout) for source, config, hardware, _, layout, _, _ in PUBLISHED]
    return out


def planner_rows(max_gpus: int | None = None) -> list[tuple]:
    """(run, hardware, GPUs, the published layout's predicted tokens/s, plan's best tokens/s,
    plan's best layout, whether the published layout fits by the estimate): `plait plan` over
    the same model, hardware, GPU count, global batch and sequence."""
    from plait.estimate.memory import estimate_memory
    from plait.estimate.planner import plan

    out = []
    for name, config, hardware, layout in published_layouts():
        if max_gpus and layout.world > max_gpus:
            continue
        hw = machine(hardware)
        published = estimate_time(config, layout, hw, 8).tokens_per_s
        best = plan(config, gpus=layout.world, global_batch=layout.global_batch, seq_len=layout.seq_len,
                    hardware=hw, gpus_per_node=8, top=1, stack=layout.stack, bucket_mb=layout.bucket_mb)[0]
        fits = estimate_memory(config, layout).total <= hw.usable_bytes
        out.append((name, hardware, layout.world, published, best["tokens_per_s"], _layout_text(best), fits))
    return out


def _layout_text(row: dict) -> str:
    schedule = f" {row['schedule']}" + (f" v{row['virtual_stages']}" if row["virtual_stages"] > 1 else "")
    shard = f"/{row['dp_shard']}" if row["dp_shard"] else ""
    return (f"dp {row['dp']} tp {row['tp']} pp {row['pp']} cp {row['cp']}{schedule if row['pp'] > 1 else ''}, "
            f"ZeRO {row['zero']}{shard}, micro {row['micro_batch']}, recompute {row['recompute']}")


# plait's own runs on a GPU (benchmarks/RESULTS.md, GPU section): the measured step beside the
# preset's prediction. (name, model spec, workload, preset, measured s/step). The offload row's
# host AdamW rate (hardware.py, host_mem_gb_s) was measured on that host by itself (AdamW alone,
# benchmarks/gpu.py --parts hostcopy), not fitted to the step.
OFFLOAD_5B = ("small,vocab_size=32000,n_layers=24,d_model=4096,n_heads=32,n_kv_heads=32,ffn_hidden=11008,"
              "max_seq_len=2048,tie_embeddings=false")
# The 1.04 B GPT of RESULTS.md's GPU section (llama-1b's shape, 32 k vocabulary), eager.
GPT_1B = ("small,vocab_size=32000,n_layers=16,d_model=2048,n_heads=32,n_kv_heads=8,ffn_hidden=8192,"
          "max_seq_len=2048,rope_theta=500000")
GPT_3B = ("small,vocab_size=32000,n_layers=28,d_model=3072,n_heads=24,n_kv_heads=8,ffn_hidden=8192,"
          "max_seq_len=2048,rope_theta=500000")
MEASURED_RUNS = (
    ("5.12 B, ZeRO-3 --offload, bf16, full recompute, 4 x 2048 tokens, 1 H200 (2026-11-27)", OFFLOAD_5B,
     Workload(dp=1, zero=3, offload=True, precision="bf16", micro_batch=4, seq_len=2048, recompute="full"),
     "h200", 2.684),
    ("1.04 B GPT, bf16, ZeRO-1, 8 x 2048 tokens, eager, 1 H200 (2026-11-27)", GPT_1B,
     Workload(dp=1, zero=1, precision="bf16", micro_batch=8, seq_len=2048), "h200", 0.280),
    ("1.04 B GPT, bf16, ZeRO-1, 8 x 2048 tokens, --compile, 1 H200 (2026-11-30)", GPT_1B,
     Workload(dp=1, zero=1, precision="bf16", micro_batch=8, seq_len=2048, compiled=True), "h200", 0.2251),
    ("1.04 B GPT, fp8 tensorwise, ZeRO-1, 8 x 2048 tokens, --compile, 1 H200 (2026-11-30)", GPT_1B,
     Workload(dp=1, zero=1, precision="fp8", micro_batch=8, seq_len=2048, compiled=True), "h200", 0.1934),
    ("3.0 B GPT (Llama 3.2 3B's shape), bf16, ZeRO-1, 4 x 2048 tokens, --compile, 1 H200 (2026-11-30)", GPT_3B,
     Workload(dp=1, zero=1, precision="bf16", micro_batch=4, seq_len=2048, compiled=True), "h200", 0.3168),
    ("3.0 B GPT, fp8 tensorwise, ZeRO-1, 4 x 2048 tokens, --compile, 1 H200 (2026-11-30)", GPT_3B,
     Workload(dp=1, zero=1, precision="fp8", micro_batch=4, seq_len=2048, compiled=True), "h200", 0.2640),
)


# llm-foundry's whole benchmark table (bf16; benchmarks/published/llm_foundry_mpt.csv, its source
# and commit in the file's head), each row priced as it ran: FSDP's FULL_SHARD as ZeRO-3 and
# SHARD_GRAD_OP as ZeRO-2, each reducing and gathering per wrapped block (llm-foundry wraps each
# MPT block: --bucket-mb of one block), activation checkpointing as full recompute. The model
# shapes are llm-foundry's yamls (scripts/train/yamls/pretrain/mpt-*.yaml): (d_model, layers, heads).
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 24, 16), "760m": (1536, 24, 12), "1b": (2048, 24, 16),
              "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 56),
              "70b": (8192, 80, 64)}
LLM_FOUNDRY_GPUS = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-80gb", "a100_40gb": "a100-40gb"}
# Composer's FSDP mixed precision (composer/distributed/mosaic_parallelism.py, get_mixed_precision):
# DEFAULT gathers the weights in the run's 16-bit type but reduce-scatters the gradients in fp32;
# PURE does both in 16 bits. The table's "MP Mode" column says which each run took.
COMPOSER_REDUCE = {"DEFAULT": "fp32", "PURE": "bf16"}
LLM_FOUNDRY_CSV = Path(__file__).resolve().parent / "published" / "llm_foundry_mpt.csv"


def llm_foundry_rows() -> list[dict]:
    """Every row of llm-foundry's table: its run, the published MFU (%), plait's, its step and
    memory estimates, whether the latter fits the GPU it ran on, and the two parameter counts
    (the table's and the model's, which must agree)."""
    import csv

    lines = [line for line in LLM_FOUNDRY_CSV.read_text().splitlines() if not line.startswith("#")]
    out = []
    for row in csv.DictReader(lines):
        d, layers, heads = MPT_SHAPES[row["model"]]
        config = replace(_mpt(d, layers, heads), max_seq_len=int(row["seq_len"]))
        layout = Workload(dp=int(row["gpus"]), zero=3 if row["sharding"] == "FULL_SHARD" else 2, precision="bf16",
                          micro_batch=int(row["micro_batch"]), grad_accum=int(row["grad_accum"]),
                          seq_len=int(row["seq_len"]), recompute="full" if row["checkpointing"] == "true" else "none",
                          bucket_mb=12 * d * d * 2 / 2**20, stack="llm-foundry",
                          reduce_dtype=COMPOSER_REDUCE[row["mp_mode"]])
        hw = get_hardware(LLM_FOUNDRY_GPUS[row["gpu"]])
        step = estimate_time(config, layout, hw, 8)
        # Their MFU: (6·n_params + 12·L·d·s) FLOPs a token, n_params the table's count, which holds
        # the runs' learned position embeddings (seq_len × d: 41% of 125m at 65,536 tokens).
        flops = 6 * int(row["params"]) + 12 * layers * d * int(row["seq_len"])
        predicted = 100 * step.tokens_per_s * flops / (layout.world * hw.peak_flops("bf16"))
        memory = estimate_memory(config, layout).total
        out.append({**row, "hardware": hw.name, "published": float(row["mfu"]), "predicted": predicted,
                    "fits": memory <= hw.usable_bytes,  # as the run did
                    "config": config, "layout": layout, "step": step, "memory_bytes": memory,
                    "model_params": config.num_params() + int(row["seq_len"]) * d})
    return out


def llm_foundry_summary() -> list[tuple]:
    """(hardware, rows, median, first and third quartiles, rows within 10%, lowest, highest, rows
    the estimate fits) of plait / published over llm_foundry_rows, per GPU."""
    rows, out = llm_foundry_rows(), []
    for hardware in dict.fromkeys(r["hardware"] for r in rows):
        ratios = sorted(r["predicted"] / r["published"] for r in rows if r["hardware"] == hardware)
        n = len(ratios)
        out.append((hardware, n, ratios[n // 2], ratios[n // 4], ratios[(3 * n) // 4],
                    sum(abs(x - 1) <= 0.10 for x in ratios), ratios[0], ratios[-1],
                    sum(r["fits"] for r in rows if r["hardware"] == hardware)))
    return out


# Why a row of llm-foundry's table lies outside 10%, read off the row itself. The rows the model
# prices over the published figure are, on every GPU, those whose FSDP transfers are heavy against
# the compute beside them (which the model hides whole: NCCL's kernels take SMs from the products
# they overlap) or whose estimate sits at the GPU's memory; the rest spread along the share of
# the step in attention, which factors per GPU on the model's lines (the step outside attention,
# and attention at each head dimension) take up.
HEAVY_WIRE = 0.15  # FSDP's collectives at least this share of the step's compute
MEMORY_EDGE = 0.90  # the estimate at least this share of the GPU's usable memory


def fsdp_wire_share(row: dict) -> float:
    """FSDP's collectives over one step, before any overlap, against the step's compute, both as
    plait prices them (exposed._dp_sync_s): ZeRO-3 (FULL_SHARD) gathers each unit before its
    forward and again before its backward (zero3_gathers) every micro-batch, ZeRO-2
    (SHARD_GRAD_OP) once a step; both reduce-scatter every micro-batch, in the reduce dtype
    (COMPOSER_REDUCE), one collective per unit of --bucket-mb (a block here)."""
    config, layout = row["config"], row["layout"]
    hw = get_hardware(row["hardware"])
    params, inter = config.num_params(), inter_node(layout, 8)["dp"]
    weights = params * state_bytes(layout.precision).param
    units = weights / layout.bucket_bytes  # the rows' --bucket-mb holds one block's weights
    gather = collective_s("all_gather", weights, layout.dp, hw, inter, units)
    reduce = collective_s("reduce_scatter", params * layout.reduce_bytes, layout.dp, hw, inter, units)
    gathers = layout.grad_accum * zero3_gathers(layout) if layout.zero == 3 else 1
    return (gathers * gather + layout.grad_accum * reduce) / row["step"].compute_s


def attention_share(row: dict) -> float:
    """The share of plait's step spent in the attention core (forward, the recomputed forward
    where the run recomputes, and backward), every block and micro-batch."""
    config, layout = row["config"], row["layout"]
    hw = get_hardware(row["hardware"])
    core = attention_time(config, layout, hw, forward_passes(layout.recompute), 1) * config.n_layers * layout.grad_accum
    return core / row["step"].step_s


# The best bf16 GEMM measured on each GPU, as a share of its dense peak: the MAMF table of
# stas00/ml-engineering (CUDA 12.1): A100 267.9 TFLOP/s of 312, H100 SXM 80% (docs/estimate.md).
BEST_GEMM = {"h100-sxm": 0.80, "a100-80gb": 267.9 / 312, "a100-40gb": 267.9 / 312}


def gemm_share(row: dict) -> float:
    """The share of plait's step in the blocks' and the head's GEMMs (the recomputed forward's
    included), as plait prices them (ops.stage_gemm_s, the head forward and backward)."""
    config, layout = row["config"], row["layout"]
    hw = get_hardware(row["hardware"])
    head = head_gemm(config, layout.tokens_per_micro_batch, layout.tp)
    head_s = sum(gemm_s(g, layout.precision, hw) for g in (head, *head.backward()))
    gemms = (stage_gemm_s(config, layout, config.n_layers, hw) + head_s) * layout.grad_accum
    return gemms / row["step"].step_s


def ceiling_rest(row: dict) -> float:
    """The most of its step a run can have spent outside its GEMMs and attention and still reach
    its published figure with both at the best GEMM rate measured on its GPU (BEST_GEMM): one
    less the published hardware FLOPs' share of peak (the table's MFU, with the recomputed
    forward counted where the run recomputes) over that rate."""
    model, hardware = flops_per_token(row["config"], row["layout"].seq_len, row["layout"].recompute)
    return 1 - row["published"] / 100 * hardware / model / BEST_GEMM[row["hardware"]]


def memory_share(row: dict) -> float:
    """plait's memory estimate of the row against its GPU's usable bytes."""
    return row["memory_bytes"] / get_hardware(row["hardware"]).usable_bytes


def head_dim(row: dict) -> int:
    """The width of one attention head in the row's model (FlashAttention's speed depends on it)."""
    return row["config"].head_dim


def fitted_lines(rows: list[dict]) -> dict[str, dict]:
    """Per GPU, the factors on plait's time outside attention ("outside") and inside it, one per
    head dimension (MPT-125M and 350M attend at 64, the rest at 128), that best fit plait /
    published over its rows with light transfers and room in memory: least squares of
    ratio ≈ (1 - share)·outside + share·factor[head dimension]. A factor f on a line at
    efficiency e is the line at e / f."""
    import numpy as np

    out = {}
    for hardware in dict.fromkeys(r["hardware"] for r in rows):
        fit = [r for r in rows if r["hardware"] == hardware and r["wire"] < HEAVY_WIRE and r["memory"] < MEMORY_EDGE]
        dims = sorted({head_dim(r) for r in fit}, reverse=True)
        matrix = np.array([[1 - r["attention"]] + [r["attention"] * (head_dim(r) == d) for d in dims] for r in fit])
        factors = np.linalg.lstsq(matrix, np.array([r["ratio"] for r in fit]), rcond=None)[0]
        out[hardware] = {"outside": float(factors[0]), **{d: float(f) for d, f in zip(dims, factors[1:])}}
    return out


def on_lines(row: dict, lines: dict) -> float:
    """The row's plait / published on its GPU's fitted lines (`fitted_lines`)."""
    return row["ratio"] / ((1 - row["attention"]) * lines["outside"] + row["attention"] * lines[head_dim(row)])


def llm_foundry_reasons() -> tuple[list[dict], dict[str, dict]]:
    """Every row of llm-foundry's table outside 10% of the published MFU, with what the row shows
    (its FSDP transfers, memory and attention shares, its ratio on its GPU's fitted lines) and
    the reason that follows, in this order: over, with heavy transfers ("collectives"); over, at
    the memory's edge ("memory"); within 10% on the fitted lines ("lines"); under, with plait's
    step outside the GEMMs longer than the published figure leaves it room for at the GPU's best
    GEMM rate, attention too ("ceiling"); else "not found".
    Also the fitted lines themselves."""
    rows = [{**r, "ratio": r["predicted"] / r["published"], "wire": fsdp_wire_share(r),
             "attention": attention_share(r), "memory": memory_share(r)} for r in llm_foundry_rows()]
    lines = fitted_lines(rows)
    out = []
    for r in rows:
        if abs(r["ratio"] - 1) <= 0.10:
            continue
        r["on_lines"] = on_lines(r, lines[r["hardware"]])
        over = r["ratio"] > 1
        # plait's time outside GEMMs and attention, as a share of the published step (ratio =
        # the published step over plait's), against the room the published rate leaves there
        r["rest"], r["rest_ceiling"] = (1 - gemm_share(r) - r["attention"]) / r["ratio"], ceiling_rest(r)
        r["reason"] = ("collectives" if over and r["wire"] >= HEAVY_WIRE else
                       "memory" if over and r["memory"] >= MEMORY_EDGE else
                       "lines" if abs(r["on_lines"] - 1) <= 0.10 else
                       "ceiling" if not over and r["rest"] > r["rest_ceiling"] else "not found")
        out.append(r)
    return out, lines


def measured_rows() -> list[tuple]:
    """(name, measured s/step, predicted s/step) of MEASURED_RUNS."""
    from plait.models.gpt.config import get_preset

    return [(name, measured, estimate_time(get_preset(spec), layout, get_hardware(hw), 8).step_s)
            for name, spec, layout, hw, measured in MEASURED_RUNS]


REASON_TEXT = {"collectives": "FSDP's transfers heavy, hidden whole by the model",
               "memory": "at the memory's edge by the estimate", "lines": "within 10% on its GPU's fitted lines",
               "ceiling": "the published rate leaves less room outside GEMMs and attention than plait's step takes",
               "not found": "not found"}


def _reason(row: dict) -> str:
    """The row's reason in words, with the figures the ceiling compares."""
    if row["reason"] == "ceiling":
        return f"{REASON_TEXT['ceiling']} ({row['rest_ceiling']:.2f} of the step against {row['rest']:.2f})"
    return REASON_TEXT[row["reason"]]


def llm_foundry_reason_tables() -> list[str]:
    """The fitted lines per GPU, then every row of llm-foundry's table outside 10% with its reason."""
    rows, fitted = llm_foundry_reasons()
    out = ["", "| llm-foundry's table, per GPU | factor on plait's time outside attention | on attention at "
           "head dimension 128 | at 64 | line outside attention: implied (preset) | attention at 128: implied "
           "(preset) | at 64: implied | rows outside 10% | of them within 10% on these lines |",
           "|---|---|---|---|---|---|---|---|---|"]
    for hardware, lines in fitted.items():
        hw, mine = get_hardware(hardware), [r for r in rows if r["hardware"] == hardware]
        at_64 = (f"{lines[64]:.3f}", f"{hw.attention_efficiency / lines[64]:.2f}") if 64 in lines else ("none", "")
        out.append(f"| {hardware} | {lines['outside']:.3f} | {lines[128]:.3f} | {at_64[0]} | "
                   f"{hw.compute_efficiency / lines['outside']:.2f} ({hw.compute_efficiency:.2f}) | "
                   f"{hw.attention_efficiency / lines[128]:.2f} ({hw.attention_efficiency:.2f}) | {at_64[1]} | "
                   f"{len(mine)} | {sum(abs(r['on_lines'] - 1) <= 0.10 for r in mine)} |")
    out += ["", "| llm-foundry row outside 10% | GPUs | micro-batch x accumulation | published MFU | plait MFU | "
            "plait / published | on the fitted lines | FSDP transfers / compute | memory / usable | attention | reason |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['hardware']} MPT-{r['model']} at {r['seq_len']} tokens, {r['sharding']}, "
            f"{'recompute' if r['checkpointing'] == 'true' else 'no recompute'}, {r['mp_mode']} | {r['gpus']} | "
            f"{r['micro_batch']} x {r['grad_accum']} | {r['published']:.2f} | {r['predicted']:.1f} | {r['ratio']:.2f} | "
            f"{r['on_lines']:.2f} | {r['wire']:.2f} | {r['memory']:.2f} | {r['attention']:.2f} | {_reason(r)} |"
            for r in rows]
    return out


def tables() -> str:
    lines = ["| params (B) | t | p | GPUs | published TFLOP/s | plait TFLOP/s | plait / published |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {s} | {t} | {p} | {g} | {pub} | {pred:.0f} | {pred / pub:.2f} |"
              for s, t, p, g, pub, pred in megatron_rows()]
    lines += ["", "| GPT-3 175 B (Table 2) | GPUs | published TFLOP/s | plait TFLOP/s | plait / published |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {g} | {pub} | {pred:.0f} | {pred / pub:.2f} |" for name, g, pub, pred in table_2_rows()]
    lines += ["", "| published run | hardware | GPUs | figure | published | plait | plait / published |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {src} | {hw} | {g} | {kind} | {pub} | {pred:.1f} | {pred / pub:.2f} |"
              for src, hw, g, kind, pub, pred in published_rows()]
    lines += ["", "| llm-foundry's whole table (bf16, MFU in its definition, --stack llm-foundry) | rows | "
              "median plait / published | middle half | within 10% | lowest | highest | fit by the estimate |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {hw} | {n} | {med:.2f} | {q1:.2f}-{q3:.2f} | {within} | {low:.2f} | {high:.2f} | {fit} |"
              for hw, n, med, q1, q3, within, low, high, fit in llm_foundry_summary()]
    lines += llm_foundry_reason_tables()
    lines += ["", "| hardware | GPUs | published tokens/s/GPU | plait tokens/s/GPU | plait / published | plait MFU (of 989) |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {g} | {pub:,} | {pred:,.0f} | {pred / pub:.2f} | {mfu:.0%} |"
              for name, g, pub, pred, mfu in torchtitan_rows()]
    lines += ["", "| published layout (plait plan over the same GPUs, batch, sequence) | hardware | GPUs | "
              "published layout, predicted tokens/s | plan's best, predicted tokens/s | best / published | plan's best |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {name}{'' if fits else ' (does not fit by the estimate)'} | {hw} | {g} | {pub:,.0f} | {best:,.0f} | "
              f"{best / pub:.2f} | {text} |" for name, hw, g, pub, best, text, fits in planner_rows()]
    lines += ["", "| plait's own run | measured s/step | predicted s/step | predicted / measured |", "|---|---|---|---|"]
    lines += [f"| {name} | {m:.2f} | {p:.2f} | {p / m:.2f} |" for name, m, p in measured_rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    text = tables()
    print(text)
    if "--write" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import write_section

        write_section("gpu-presets", "## Published runs: predicted vs published\n\n- command: "
                      "`python benchmarks/gpu_presets.py --write` (arithmetic, no GPU)\n\n" + text)
