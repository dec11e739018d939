"""A sweep over transformers' causal-LM families: each trains like one process, or is refused. One spawn.

For every family of FAMILIES (a tiny model built by `AutoConfig.for_model` from one seed, no
plan and no adapter from the user) and every mode it declares a plan for, 2 AdamW steps of 2
micro-batches on the same global batches, against one process training the whole batch:

- "tp": init_mesh(tp=2), run where `model.tp_plan` is non-empty;
- "tp_sp": the same with sequence parallelism;
- "pp": init_mesh(pp=2, schedule="1f1b"), the 2 micro-batches through a PipelineRunner;
  always tried (plait may find the cut without a pp_plan);
- "ep" (the families declaring an ep plan): init_mesh(dp=2, ep=2), each rank its half of
  every batch, plait.no_sync on the first micro-batch, the dp-mean loss.

Each tp and tp_sp case trains as `plait train` does (its head split by vocabulary where the plan
allows: plait's vocab-parallel loss reads the slices), and its tp bytes per step, as the ledger
counts them, are held to what plait's estimate predicts for the family's shape (measured_shape,
from its config.json and the model built on meta): "wire" is "priced" where they are equal, op
by op, else what was measured and predicted (an exact case only). A pp case's bytes on every
axis are held so too, each rank's to its stage's; an ep case's (the experts' all-to-all, the
data ranks' sync) as well, the all-to-all within ROUTING_BAND of its price at uniform routing
(it sends the rows the router chose). Each exact tp, tp_sp, pp and
ep case also holds the parameters each rank holds to the estimate's for that rank ("counted",
else what each rank holds and was given).

Each case is classified (`verdict`): "exact" (every loss within rtol 1e-4 of the reference,
the final parameters, gathered whole, within rtol 1e-4 / atol 5e-6 elementwise), "refused"
(a PlaitError: its first line), "different" (ran, numbers differ: the worst loss or
parameter), "crash" (any other exception, or a PlaitError on one rank only: a rank left
waiting for the other), "n/a" (the model declares no plan for the mode). One case cannot
stop the sweep: each is caught, and the ranks agree on the verdict after it (over a group
of their own); a rank stuck in a collective its peer never entered gives up after
COLLECTIVE_TIMEOUT_S and the case is a crash naming the timeout. Every rank rewrites its
report after each case, so a world that dies still shows where.

Report (every rank): "cases" {family/mode: {verdict, detail, seconds}} (the ranks' agreed
verdicts), "mine" (this rank's own), "plans", "seconds"; rank 0 adds "table" {family: {mode:
verdict}} and "counts" {verdict: n}, for docs.

argv (for a partial sweep by hand): [families,comma,separated [modes,comma,separated]].
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import plait
import plait.models.adapters
from plait.errors import PlaitError
from plait.estimate.layout import Workload, layout_stages
from plait.estimate.traffic import rank_traffic
from plait.models.hf.config import read_hf_dir
from plait.models.hf.load import measured_shape
from plait.parallel.placement import placement_of
from plait.parallel.tensor.loss import lm_loss
from plait.parallel.tensor.ops import all_gather_stacked
from plait.parallel.tensor.plan import gather_full_params
from plait.runtime import comm
from tests.worldlib import save_report
from tests.worlds.hf_common import pipeline_steps

SEED, STEPS, BATCH, ACCUM, SEQ, VOCAB = 0, 2, 4, 2, 16, 128
# Adam moves an element whose gradient is near zero by up to lr·δg/eps for a last-bit δg (another
# summation order: tests/worlds/hf_plans_world.py). At eps 1e-6 olmo2's tp embedding drifted by
# 1.1e-5 on one 2-core AVX2 machine and not on another; eps 1e-5 keeps such noise a tenth of that,
# under the parameters' atol, while a real split error still moves the losses and parameters.
ADAM = dict(lr=1e-3, weight_decay=0.0, eps=1e-5)
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4, 5e-6
COLLECTIVE_TIMEOUT_S = 30  # a rank left alone in a collective gives up after this (the process group's timeout)
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)  # 4 experts, top 2, under each family's names
# model_type -> what SHAPE does not say (overrides SHAPE's fields where both name one).
# FAMILIES and MORE hold every causal LM of transformers 5.24 whose config declares a tp plan
# and that builds tiny and trains one process in well under a second. Left out, with why:
#   llama4, gemma3, qwen3_5 (their multimodal classes) and phi4_multimodal: AutoModelForCausalLM
#     builds the vision tower at full size (their *_text models are here);
#   the *_vl / omni / ocr / audio / encoder families: no AutoModelForCausalLM class;
#   falcon (SHAPE's head_dim is a read-only property of its config), xlstm (fails at SHAPE),
#     blt (a minute to build);
#   families that declare no tp plan (gpt2 has its own adapter; stablelm, mpt, bloom, opt...):
#     pp and ep only, not swept here.
FAMILIES: dict[str, dict[str, Any]] = {
    # dense
    "llama": {},
    "mistral": dict(sliding_window=6),
    "qwen2": {},
    "qwen3": dict(tie_word_embeddings=True),
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "cohere": {},
    "cohere2": {},
    "olmo": {},
    "olmo2": {},
    "phi3": dict(pad_token_id=0),
    "granite": {},
    "starcoder2": {},
    "glm": dict(pad_token_id=0),
    "helium": {},
    "smollm3": dict(pad_token_id=0),
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": {},
    "arcee": {},
    "apertus": {},
    "hunyuan_v1_dense": {},
    "granite_swa": {},  # attention sinks, a parameter split by its heads ("sinks": colwise)
    # mixtures of experts
    "olmoe": dict(num_experts=4, **MOE),
    "phimoe": dict(num_local_experts=4, router_jitter_noise=0.0, input_jitter_noise=0.0, **MOE),
    "mixtral": dict(num_local_experts=4, **MOE),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, **MOE),
    "qwen3_moe": dict(num_experts=4, **MOE),
    "qwen3_next": dict(num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48,
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, **MOE),
    "minimax": dict(num_local_experts=4, **MOE),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, moe_intermediate_size=32),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **MOE),
    # MLA: no grouped kv heads, the rotary part of q/k as wide as head_dim (the rotary angles' width)
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, **MOE),
    # MLA with its key projection split as declared ("mla_kv_a_proj": the rotary key enters whole)
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **MOE),
    # Llama 4's text model: experts packed as (E, hidden, 2·d) and run densely on every token,
    # scaled by a sigmoid of the router's top scores; a dense layer, then an MoE one; a layer
    # without rotary angles; attention chunks of 8 tokens (shorter than the sequence)
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=2,
                        interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=8),
}
# More families, each tiny (a reference well under 0.2 s here): every other causal LM of
# transformers 5.24 whose config declares a tp plan and that builds tiny, with the fields each
# needs (MLA dims as deepseek_v3's, 4 experts of top 2, windows shorter than the sequence).
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
DSMOE = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **MOE)
IDX = dict(index_topk=8, index_head_dim=8, index_n_heads=2)  # an indexer's attention
LIN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
SW2 = ["sliding_attention", "full_attention"]
MORE: dict[str, dict[str, Any]] = {
    "apertus1p5_text": {},
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 1, 1]}}),
    "cwm": dict(sliding_window=6),
    "diffllama": {},
    "exaone": {},
    "glm4": dict(pad_token_id=0),
    "gpt_neox": {},
    "hyperclovax": {},
    "internlm3": {},
    "iquestcoder": {},
    "jais2": {},
    "ministral": dict(sliding_window=6),
    "ministral3": {},
    "nanochat": {},
    "nemotron": {},
    "olmo3": dict(sliding_window=6),
    "phi": {},
    "vaultgemma": dict(sliding_window=6, query_pre_attn_scalar=8),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm3": dict(pad_token_id=0, sliding_window=6, num_hidden_layers=3, layer_types=["conv", "sliding_attention",
                 "full_attention"]),
    "gemma3n_text": dict(layer_types=SW2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                         num_kv_shared_layers=0, laurel_rank=8, sliding_window=6),
    "gemma4_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, sliding_window=6,
                        global_head_dim=16, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32),
    "gemma4_unified_text": dict(sliding_window=6, global_head_dim=16),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=1, sliding_window=6),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=4),
    "minicpm3": dict(**MLA),
    "youtu": dict(**MLA),
    "afmoe": dict(num_experts=4, num_shared_experts=1, num_dense_layers=1, sliding_window=6,
                  global_attn_every_n_layers=2, **MOE),
    "aria_text": dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
    "beam": dict(mlp_layer_types=["dense", "sparse"], num_experts=4, n_group=1, topk_group=1, sliding_window=6,
                 **MOE),
    "cohere2_moe": dict(layer_types=SW2, num_experts=4, num_experts_per_tok=2, sliding_window=6),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=32,
                         moe_layer_start_index=1, moe_layer_end_index=1),
    "exaone_moe": dict(num_experts=4, num_shared_experts=1, first_k_dense_replace=1, sliding_window=6,
                       sliding_window_pattern=2, n_group=1, topk_group=1, **MOE),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0),
    "flint": dict(layer_types=SW2, num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                  sliding_window=6, **MOE),
    "glm4_moe": dict(**DSMOE),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=6),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=6),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48),
    "hy_v3": dict(num_experts=4, num_shared_experts=1, **MOE),
    "kolibri1": dict(layer_types=SW2, num_local_experts=4, shared_expert_intermediate_size=48, sliding_window=6,
                     **MOE),
    "laguna": dict(layer_types=SW2, num_experts=4, shared_expert_intermediate_size=48, sliding_window=6, **MOE),
    "mellum": dict(layer_types=SW2, num_local_experts=4, sliding_window=6, **MOE),
    "mimo_v2_flash": dict(n_routed_experts=4, n_group=1, topk_group=1, v_head_dim=8, sliding_window=6, **MOE),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "minimax_m3_vl_text": dict(layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense",
                               "sparse"], num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                               dense_intermediate_size=64, shared_intermediate_size=32, rotary_dim=8, index_n_heads=2,
                               index_head_dim=8, index_block_size=4, index_topk_blocks=2),
    "sarvam_moe": dict(**DSMOE),
    "solar_open": dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, **MOE),
    "lfm2_moe": dict(num_experts=4, num_dense_layers=1, layer_types=["conv", "full_attention"], **MOE),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=8, mamba_d_state=8),
    "deepseek_v32": dict(**MLA, **DSMOE, **IDX),
    "glm4_moe_lite": dict(**MLA, **DSMOE),
    "glm_moe_dsa": dict(**MLA, **DSMOE, **IDX),
    "sarvam_mla": dict(**MLA, **DSMOE),
    "axk1": dict(**MLA, **DSMOE),
    # q_gate_proj reads both q latents, 2·q_lora_rank: not the hidden's 32 (the estimate tells a
    # layer reading the block's input by its width)
    "axk2": dict(**{**MLA, "q_lora_rank": 12}, **DSMOE, **IDX),
    "longcat_flash": dict(**MLA, num_hidden_layers=4, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                          n_routed_experts=4, zero_expert_num=2, moe_topk=2),
    "kimi_linear": dict(**MLA, layer_types=["linear_attention", "full_attention"], pad_token_id=0, linear_head_dim=8,
                        linear_num_heads=4, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                        moe_intermediate_size=32),
    "bailing_hybrid": dict(**MLA, pad_token_id=0, num_experts=4, num_experts_per_token=2, num_expert_group=1,
                           topk_group=1, num_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                           linear_head_dim=8, linear_num_heads=4, layer_group_size=2),
    "hy_v4": dict(**MLA, **DSMOE, **IDX, pad_token_id=0),
    "dots3_note_text": dict(**MLA, **DSMOE, **IDX, pad_token_id=0, sliding_window=6, per_layer_config={},
                            shared_experts_intermediate_size=32),
    "deepseek_v4": dict(head_dim=8, q_lora_rank=16, n_routed_experts=4, n_shared_experts=1, **MOE, o_groups=2,
                        o_lora_rank=16, index_n_heads=2, index_head_dim=8, index_topk=8, sliding_window=6,
                        qk_rope_head_dim=4, num_nextn_predict_layers=0, num_key_value_heads=1,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"], compress_rates={"compressed_sparse_attention": 2,
                        "heavily_compressed_attention": 4}),
    "qwen3_5_text": dict(**LIN, num_hidden_layers=4),
    "qwen3_5_moe_text": dict(**LIN, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48, **MOE),
    "lara_mini": dict(**LIN, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48, sliding_window=6,
                      **MOE),
    "olmo_hybrid": dict(**LIN, pad_token_id=0, layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(**LIN, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48, **MOE,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                           indexer_compress_ratio=2, hc_count=2, hc_lowrank=8),
    "bamba": dict(**MAMBA, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8),
    "granitemoehybrid": dict(**MAMBA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48, layer_types=["mamba", "attention"]),
    "nemotron_h": dict(num_hidden_layers=4, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                       chunk_size=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, num_experts_per_tok=2),
    "inkling_text": dict(layer_types=["hybrid_sliding", "hybrid"], logits_mup_width_multiplier=1.0,
                         swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6,
                         n_routed_experts=4, n_shared_experts=1, **MOE),
    "inkling2_text": dict(layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=1,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6,
                          n_routed_experts=4, **MOE, unpadded_vocab_size=128),
    "inkling2_loop_text": dict(num_hidden_layers=3, n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                               loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6, n_routed_experts=4,
                               **MOE, unpadded_vocab_size=128),
    # Dory again, its recurrent block run twice a forward (GPTConfig.block_runs): its tp
    # collectives, split blocks, run again each run
    "dory_looped": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                        n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                        sliding_window=6),
}
FAMILIES.update(MORE)
MODEL_TYPES = {"dory_looped": "dory"}  # a family's second configuration: the model type it builds
# Families that declare no plan (or no tp plan): their cut and tp plan are inferred where they
# are laid out as their siblings (plait.models.hf.inferred); tp where one is, pp always.
UNDECLARED: dict[str, dict[str, Any]] = {
    "stablelm": {},
    "persimmon": {},
    "mpt": {},
    "bloom": {},
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_bigcode": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "xglm": dict(ffn_dim=64),
    "biogpt": {},
    "ctrl": dict(dff=64, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox_japanese": {},
    "bitnet": {},
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "mamba": {},
    "falcon_mamba": {},
    "rwkv": {},
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=6),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"], mamba_d_state=8,
                  mamba_dt_rank=8),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], mamba_d_state=8, mamba_headdim=8,
                   n_mamba_heads=8, chunk_size=8),
    "mamba2": dict(num_heads=8, n_groups=1, chunk_size=8, state_size=16),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=6, lru_width=32),
    "dbrx": dict(d_model=32, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"hidden_size": 32, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "modernbert-decoder": dict(pad_token_id=0, local_attention=6),
    "zaya": dict(num_experts=4, moe_intermediate_size=32, router_hidden_size=16),
}
FAMILIES.update(UNDECLARED)
# PhiMoE's router samples in training (sparsemixer: Gumbel noise among the experts within
# router_jitter_noise of the best, and a random midpoint mask in backward), like dropout: the
# stages of a pipeline or the ranks of ep draw from their own generators. With the jitter at
# 0 only the best expert is ever a candidate and the mask is always on: its training, random
# numbers drawn and all, is deterministic, as dropout 0 makes the others'.
MODES = ("tp", "tp_sp", "pp", "ep")
torch.set_num_threads(1)
warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()


def family_config(family: str) -> Any:
    config = AutoConfig.for_model(MODEL_TYPES.get(family, family), **{**SHAPE, **FAMILIES[family]})
    for key, value in list(vars(config).items()):  # every dropout off (names differ by family)
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def build(family: str) -> torch.nn.Module:
    """The family's model as `from_config` builds it from SEED, and the generator as it leaves
    it (a sampled router draws from it in training): a copy of the first build, since each
    family's cases build it four or five times in a row and a copy costs a fraction of a build
    (the sweep world spent 15 of its 140 s profiled in from_config)."""
    model, generator = _first_build(family)
    model = copy.deepcopy(model)
    torch.set_rng_state(generator)
    return model


@functools.lru_cache(maxsize=1)  # the families run one after another
def _first_build(family: str) -> tuple[torch.nn.Module, torch.Tensor]:
    config = family_config(family)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    return model, torch.get_rng_state()


# family -> its shape (a frozen GPTConfig), or what reading it raised, named (`named`): read
# once a family, on the rank that computed its reference, and handed to every rank with it
SHAPES: dict[str, Any] = {}


class Unread(Exception):
    """A family's shape whose reading failed, on whichever rank read it: that error, named."""


def family_shape(family: str) -> Any:
    """The family's shape as `plait train --model hf:DIR` reads it (shared_references read it);
    each of its exact cases reads it twice."""
    shape = SHAPES[family]
    if isinstance(shape, str):
        raise Unread(shape)
    return shape


def read_shape(family: str) -> Any:
    """The family's shape as `plait train --model hf:DIR` reads it (its config.json written to
    a directory, the model built on meta), less what autograd keeps: the sweep reads its
    parameters and traffic alone. Else what reading it raised, named. A reading builds the
    model and runs forwards on meta: 0.18 s a family here, and each rank had read every one
    (12 of a world's 79 s a rank)."""
    try:
        with tempfile.TemporaryDirectory() as folder:
            family_config(family).save_pretrained(folder)
            return measured_shape(read_hf_dir(f"hf:{folder}"), kept=False)
    except Exception as error:  # noqa: BLE001 - the estimate's failing is a case's wire or count finding
        return named(error)


def sweep_layout(mode: str) -> Workload:
    """`mode`'s run as the estimate reads it: tp 2 (with SP for tp_sp), pp 2 (1F1B), or dp 2 × ep 2."""
    ep, pp = mode == "ep", mode == "pp"
    dp = 2 if ep else 1  # each ep rank trains its half of every batch
    return Workload(tp=1 if ep or pp else 2, dp=dp, ep=2 if ep else 1, pp=2 if pp else 1,
                    sp=mode == "tp_sp", schedule="1f1b", micro_batch=BATCH // dp // ACCUM, grad_accum=ACCUM,
                    seq_len=SEQ, precision="fp32")


def predicted_wire(family: str, sp: bool) -> dict[str, float]:
    """plait's estimate of one step's tp bytes in tensor_parallel's run: {op: wire bytes}."""
    return predicted_traffic(family, "tp_sp" if sp else "tp").get("tp", {})


def rank_stage(family: str, mode: str) -> tuple[Any, Workload, Any]:
    """The family's shape, `mode`'s layout and this rank's share of it as the estimate reads
    them (each pipeline rank its own stage)."""
    shape, layout = family_shape(family), sweep_layout(mode)
    return shape, layout, layout_stages(shape, layout)[dist.get_rank() if mode == "pp" else 0]


def predicted_traffic(family: str, mode: str) -> dict[str, dict[str, float]]:
    """plait's estimate of one step's bytes on this rank in `mode`'s run, every axis, without the
    gradient norm's sums and the routing counts' (the sweep neither clips nor counts, as `plait
    train` does): {axis: {op: wire bytes}}."""
    shape, layout, stage = rank_stage(family, mode)
    return rank_traffic(replace(shape, counts_routing=False), layout, stage, clipped=False)


def predicted_local(family: str, mode: str) -> int:
    """plait's estimate of the parameters one rank holds in `mode`'s run."""
    return rank_stage(family, mode)[2].params


# An ep case's experts' dispatch, against the estimate's uniform routing: a tiny model's router
# sent 0.89-1.18 of it across the sweep's mixtures of experts (2026-12-02); a block priced
# twice or not at all, or rows of another width, fall outside.
EXPERT_DISPATCH, ROUTING_BAND = "ep all_to_all", (0.8, 1.25)


def flat(traffic: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"axis op": bytes}: every axis's ops in one table, as wire_verdict compares them."""
    return {f"{axis} {op}": wire for axis, ops in traffic.items() for op, wire in ops.items()}


def wire_verdict(measured: dict[str, float], predicted: dict[str, float], routed: bool = False) -> str:
    """ "priced", or what differs: the ops' bytes measured and predicted. `routed` (an ep case):
    the experts' all-to-all is what the router chose to send, priced at uniform routing, and
    held to ROUTING_BAND of it; every other op exactly."""
    held = measured
    if routed and EXPERT_DISPATCH in measured and EXPERT_DISPATCH in predicted:
        ratio = measured[EXPERT_DISPATCH] / predicted[EXPERT_DISPATCH]
        if ROUTING_BAND[0] <= ratio <= ROUTING_BAND[1]:
            held = {**measured, EXPERT_DISPATCH: predicted[EXPERT_DISPATCH]}
    if held == predicted:
        return "priced"
    ops = sorted({*measured, *predicted})
    return "; ".join(f"{op} measured {measured.get(op, 0):.0f}, predicted {predicted.get(op, 0):.0f}" for op in ops)


def plans(model: torch.nn.Module) -> dict[str, bool]:
    """What the model declares, or plait infers (a tp plan read off its layer names)."""
    return {"tp": bool(getattr(model, "tp_plan", None) or inferred(model)), "pp": bool(getattr(model, "pp_plan", None)),
            "ep": bool(getattr(model.config, "base_model_ep_plan", None) or getattr(model, "ep_plan", None)
                       or "moe_tp_experts" in (getattr(model, "tp_plan", None) or {}).values())}


def inferred(model: torch.nn.Module) -> bool:
    """Whether plait has a tp plan for a model that declares none: a hand-written adapter's
    (GPT-2's), or one read off its layer names."""
    from plait.models.hf.inferred import inferred_tp_plan
    from plait.models.hf.plans import DeclaredPlanAdapter, block_list

    adapter = plait.models.adapters.adapter_for(model)
    if adapter is None or not isinstance(adapter, DeclaredPlanAdapter):
        return adapter is not None
    return bool(inferred_tp_plan(model, block_list(model)))


def applies(mode: str, declared: dict[str, bool]) -> bool:
    return {"tp": declared["tp"], "tp_sp": declared["tp"], "pp": True, "ep": declared["ep"]}[mode]


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: Any, batches: list[torch.Tensor], optimizer: Any, sync: Any = None,
          loss_of: Any = loss_fn) -> list[float]:
    """AdamW steps of ACCUM micro-batches (loss_of / ACCUM); `sync` wraps all but the last."""
    losses = []
    for rows in batches:
        micro, total = rows.chunk(ACCUM), 0.0
        for i, part in enumerate(micro):
            with sync(model) if sync and i < len(micro) - 1 else contextlib.nullcontext():
                loss = loss_of(model(input_ids=part[:, :-1]).logits, part[:, 1:])
                (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def detached(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in params.items()}


def reference(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    model = build(family)
    losses = train(model, batches, torch.optim.AdamW(model.parameters(), **ADAM))
    return {"losses": losses, "params": detached(dict(model.named_parameters()))}


MESHES: dict[tuple, Any] = {}


def mesh_of(**layout: Any) -> Any:
    """One mesh per layout for the whole sweep: each new mesh makes process groups of its own
    (a thread each under Gloo), which, a few hundred cases on, slow every collective."""
    key = tuple(sorted(layout.items()))
    if key not in MESHES:
        MESHES[key] = plait.init_mesh(**layout)
    return MESHES[key]


def tensor_parallel(family: str, batches: list[torch.Tensor], sp: bool = False) -> dict[str, Any]:
    """As `plait train --tp 2` runs it: the head's logits left split by vocabulary where the plan
    allows, read by the vocab-parallel loss; the ledger's tp bytes a step beside the estimate's."""
    mesh = mesh_of(tp=2, sp=sp)
    model = plait.parallelize(build(family), mesh, plait.ParallelConfig(split_logits=True))
    local = sum(p.numel() for p in model.parameters())
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, **ADAM)

    def split_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets, axis=mesh.axis("tp") if logits.shape[-1] != VOCAB else None)

    before = mesh.ledger.snapshot()
    losses = train(model, batches, optimizer, loss_of=split_loss)
    wire = {op: moved / STEPS for op, moved in mesh.ledger.since(before).get("tp", {}).items()}
    whole = gather_full_params(model, purpose=comm.TELEMETRY)  # a collective: every rank gathers
    return {"losses": losses, "params": detached(whole), "whole": True, "wire": wire, "local": local}


def pipelined(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """pp 2, 1F1B: a step's ACCUM micro-batches are the pipeline's; each rank its stages' parameters."""
    mesh = mesh_of(pp=2, schedule="1f1b")
    stages = plait.parallelize(build(family), mesh, plait.ParallelConfig())
    local = sum(p.numel() for p in {id(p): p for stage in stages for p in stage.parameters()}.values())
    optimizer = plait.build_optimizer(stages, torch.optim.AdamW, **ADAM)
    before = mesh.ledger.snapshot()
    out = pipeline_steps(stages, mesh, batches, ACCUM, loss_fn, optimizer)
    return {"losses": out["losses"], "params": detached(out["held"]), "whole": False, "local": local,
            "wire": per_step(mesh.ledger.since(before))}


def expert_parallel(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """dp 2 × ep 2: each rank trains its half of every global batch; the dp-mean loss; the
    experts' halves gathered whole."""
    mesh = mesh_of(dp=2, ep=2)
    model = plait.parallelize(build(family), mesh, plait.ParallelConfig())
    local = sum(p.numel() for p in model.parameters())
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, **ADAM)
    half = [rows.chunk(2)[mesh.rank("dp")] for rows in batches]
    before = mesh.ledger.snapshot()
    trained = train(model, half, optimizer, sync=plait.no_sync)
    wire = per_step(mesh.ledger.since(before))
    losses = [dp_mean(loss, mesh) for loss in trained]
    whole = {}
    for name, param in model.named_parameters():
        placement = placement_of(param)
        tensor = param.detach()
        if placement.split("ep") is not None:  # every ep rank's experts, joined in ep-rank order
            tensor = placement.join(all_gather_stacked(tensor.contiguous(), mesh.axis("ep"), comm.TELEMETRY), "ep")
        whole[name] = tensor.clone()
    return {"losses": losses, "params": whole, "whole": True, "local": local, "wire": wire}


def per_step(moved: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The ledger's bytes over the sweep's steps, per step: {axis: {op: bytes}}."""
    return {axis: {op: total / STEPS for op, total in ops.items()} for axis, ops in moved.items() if ops}


def dp_mean(value: float, mesh: Any) -> float:
    mean = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
    return mean.item() / mesh.size("dp")


RUNS = {"tp": tensor_parallel, "tp_sp": lambda family, batches: tensor_parallel(family, batches, sp=True),
        "pp": pipelined, "ep": expert_parallel}


def compare(found: dict[str, Any], expected: dict[str, Any]) -> tuple[str, str]:
    """("exact" | "different", detail): the worst loss, then the worst parameter element."""
    losses, want = found["losses"], expected["losses"]
    if len(losses) != len(want):
        return "different", f"{len(losses)} losses, expected {len(want)}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    if not rel <= LOSS_RTOL:
        return "different", f"loss rel diff {rel:.2e} (losses {[round(x, 6) for x in losses]}, " \
                            f"expected {[round(x, 6) for x in want]})"
    params, reference_params = found["params"], expected["params"]
    missing = sorted(set(params) - set(reference_params))
    if missing or (found["whole"] and set(params) != set(reference_params)):
        extra, absent = missing[:3], sorted(set(reference_params) - set(params))[:3]
        return "different", f"parameter names differ: extra {extra}, missing {absent}"
    worst, worst_name = float("-inf"), ""
    for name, tensor in params.items():
        ref = reference_params[name]
        if tensor.shape != ref.shape:
            return "different", f"parameter {name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}"
        excess = ((tensor.float() - ref.float()).abs() - PARAM_ATOL - PARAM_RTOL * ref.float().abs()).max().item()
        if not excess <= worst:
            worst, worst_name = excess, name
    if worst > 0 or worst != worst:
        return "different", f"parameter {worst_name} off by {worst:.2e} beyond rtol {PARAM_RTOL}/atol {PARAM_ATOL}"
    return "exact", f"loss rel diff {rel:.1e}"


def run_case(family: str, mode: str, batches: list[torch.Tensor], expected: dict[str, Any]) -> dict[str, Any]:
    start, measured = time.perf_counter(), None
    try:
        found = RUNS[mode](family, batches)
        verdict, detail = compare(found, expected)
        held = sorted(found["params"]) if not found["whole"] else None
        measured = found.get("wire") if verdict == "exact" else None
    except PlaitError as error:
        verdict, detail, held = "refused", first_line(error), None
    except Exception as error:  # noqa: BLE001 - a sweep: any other exception is this case's finding
        verdict, detail, held = "crash", f"{type(error).__name__}: {first_line(error)}", None
    case = {"verdict": verdict, "detail": detail, "seconds": round(time.perf_counter() - start, 3), "held": held}
    if verdict == "exact" and "local" in found:  # what a rank holds beside what the estimate gives it
        try:
            predicted = predicted_local(family, mode)
            case["counted"] = "counted" if predicted == found["local"] else \
                f"holds {found['local']}, estimated {predicted}"
        except Exception as error:  # noqa: BLE001
            case["counted"] = f"not estimated: {named(error)}"
    if measured is None:
        return case
    try:  # the estimate's failing is this case's wire finding, not its verdict's
        if mode in ("tp", "tp_sp"):
            wire = wire_verdict(measured, predicted_wire(family, mode == "tp_sp"))
        else:
            wire = wire_verdict(flat(measured), flat(predicted_traffic(family, mode)), routed=mode == "ep")
    except Exception as error:  # noqa: BLE001
        wire = f"not estimated: {named(error)}"
    return {**case, "wire": wire}


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:400] if text else type(error).__name__


def named(error: BaseException) -> str:
    """ "Type: its first line"; an Unread shape's, as it was named where it was read."""
    return str(error) if isinstance(error, Unread) else f"{type(error).__name__}: {first_line(error)}"


def agree(mine: dict[str, Any], expected: dict[str, Any], group: Any) -> dict[str, Any]:
    """The ranks' verdicts, as one: the same on every rank, or the worst, saying which rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    verdicts = [case["verdict"] for case in everyone]
    seconds = max(case["seconds"] for case in everyone)
    if len(set(verdicts)) == 1 and verdicts[0] == "exact" and everyone[0]["held"] is not None:
        held = {name for case in everyone for name in case["held"]}  # pp: the stages hold the whole model
        if held != set(expected["params"]):
            return {"verdict": "different", "seconds": seconds,
                    "detail": f"the stages hold {len(held)} parameters, the model {len(expected['params'])}: "
                              f"missing {sorted(set(expected['params']) - held)[:3]}"}
    if len(set(verdicts)) == 1:
        wires = [case.get("wire") for case in everyone]  # each rank's (a pipeline's stages differ)
        said = {"wire": wires[0]} if wires[0] else {}
        if any(wire != wires[0] for wire in wires):
            said["wire"] = "; ".join(f"rank {rank}: {wire}" for rank, wire in enumerate(wires) if wire != "priced")
        counts = [case.get("counted") for case in everyone]  # each rank's (a pipeline's stages differ)
        if any(counts):
            off = [f"rank {rank}: {count}" for rank, count in enumerate(counts) if count != "counted"]
            said["counted"] = "; ".join(off) if off else "counted"
        return {"verdict": verdicts[0], "detail": everyone[0]["detail"], "seconds": seconds, **said}
    if "refused" in verdicts and "crash" not in verdicts and "different" not in verdicts:
        rank = verdicts.index("refused")  # refused on one rank only: the other would have hung
        return {"verdict": "crash", "seconds": seconds,
                "detail": f"refused on rank {rank} only: {everyone[rank]['detail']}"}
    for worst in ("crash", "different", "refused"):
        if worst in verdicts:
            rank = verdicts.index(worst)
            return {"verdict": worst, "seconds": seconds,
                    "detail": f"rank {rank}: {everyone[rank]['detail']} (ranks: {verdicts})"}
    raise AssertionError(verdicts)


def shared_references(families: list[str], batches: list[torch.Tensor], group: Any,
                      report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each family's plans, one-process reference and shape (`read_shape`, into SHAPES),
    computed by one rank (the families dealt out in turn) and handed to every rank: each rank
    had computed every reference itself, the same numbers twice (16.6 s of references in the
    whole sweep: 8.4 s a rank now), and read every shape. A family that does not build or train
    here is its error's line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, dict[str, Any]] = {}
    for family in families[rank::world]:
        report["in_progress"] = f"{family}/reference"
        save_report(report)
        begun = time.perf_counter()
        try:
            mine[family] = {"declared": plans(build(family)), "expected": reference(family, batches)}
        except Exception as error:  # noqa: BLE001 - the family itself does not build or train here
            mine[family] = {"error": f"reference: {type(error).__name__}: {first_line(error)}"}
        mine[family]["seconds"] = round(time.perf_counter() - begun, 3)
        if "error" not in mine[family]:
            mine[family]["shape"] = read_shape(family)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    found = {family: found for part in everyone for family, found in part.items()}
    SHAPES.update({family: found[family].pop("shape") for family in found if "shape" in found[family]})
    return found


def main() -> None:
    families = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else list(FAMILIES)
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODES)
    started = time.perf_counter()
    plait.init_mesh(timeout_s=COLLECTIVE_TIMEOUT_S)  # the world's process group, with the sweep's timeout
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4 * COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    batches = data()
    report: dict[str, Any] = {"cases": {}, "mine": {}, "plans": {}, "families": families, "modes": modes}
    references = shared_references(families, batches, group, report)
    report["reference_seconds"] = {family: references[family]["seconds"] for family in families}
    for family in families:
        if "error" in references[family]:
            for mode in modes:
                report["cases"][f"{family}/{mode}"] = {"verdict": "crash", "seconds": 0.0,
                                                       "detail": references[family]["error"]}
            continue
        declared, expected = references[family]["declared"], references[family]["expected"]
        report["plans"][family] = declared
        for mode in modes:
            key = f"{family}/{mode}"
            if not applies(mode, declared):
                report["cases"][key] = report["mine"][key] = {"verdict": "n/a", "detail": "", "seconds": 0.0}
                continue
            report["in_progress"] = key
            save_report(report)  # a world that hangs or dies here still shows which case
            mine = run_case(family, mode, batches, expected)
            report["cases"][key] = agree(mine, expected, group)
            if report["cases"][key]["verdict"] == "crash":  # its groups may be left mid-collective: new ones
                MESHES.clear()
            report["mine"][key] = {k: v for k, v in mine.items() if k != "held"}
    report.pop("in_progress", None)
    report["seconds"] = round(time.perf_counter() - started, 2)
    if rank == 0:
        report["table"] = {family: {mode: report["cases"].get(f"{family}/{mode}", {}).get("verdict")
                                    for mode in modes} for family in families}
        counts: dict[str, int] = {}
        for case in report["cases"].values():
            counts[case["verdict"]] = counts.get(case["verdict"], 0) + 1
        report["counts"] = counts
    save_report(report)
    if os.environ.get("PLAIT_SWEEP_PRINT") and rank == 0:
        for key, case in report["cases"].items():
            print(f"{key:28s} {case['verdict']:9s} {case['seconds']:6.2f}s  {case['detail'][:160]}")
        print(f"counts {report['counts']}  world {report['seconds']}s")


if __name__ == "__main__":
    main()
