"""What the shape reader (plait/models/hf/load.py: measured_shape) finds in a transformers model
whose blocks differ, or whose attention holds layers the loss sends no gradient: each number is
one the wire sweep (tests/test_hf_sweep.py, make test-all) holds the ledger to, read here in a
second on the meta device.

- Qwen3-Next: three linear-attention blocks in four, whose plan gathers the three projections
  whole (no row layer closes them: two entries each in backward, in_proj's shared input and
  out_proj's), and one full attention with per-head q/k norms;
- LARA: two of four linear, only their out_proj split (one entry each);
- OLMo-hybrid: one linear attention no entry names (whole), one full;
- Gemma 4 unified: its global layers' heads twice as wide, their q/k norms too;
- DeepSeek-V3.2: MLA's down-projections and their norms summed under SP, its indexer not (it
  picks keys by top-k: no gradient reaches it)."""

from __future__ import annotations

from dataclasses import replace
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.estimate.context import layer_bytes as context_layer_bytes
from plait.estimate.layout import Workload, block_split, embedding_rows, held_experts, layout_stages, vocab_shard
from plait.errors import PlaitError
from plait.models.hf.config import read_hf_dir
from plait.models.hf.gated import remake_gated_products
from plait.models.hf.load import measured_shape

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, num_experts=4, shared_expert_intermediate_size=48)
LINEAR = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
           num_experts_per_tok=2, moe_intermediate_size=32, index_topk=8, index_head_dim=8, index_n_heads=2)


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)

# The plans transformers 5.24 declares for three families whose plan features tests here read
# (experts split by tp, Nemotron-H's blocks none of which its plan splits). 5.25 declares others
# (its experts whole, dispatched by an ep plan; Nemotron-H's attention split by name), which the
# wire sweep runs as they come. Set on the config class, so each test reads the plan it is about
# whichever release is installed: (tp plan, ep plan), None where the release declares none.
PLANS_524 = {
    "inkling_text": ({"layers.*.mlp.experts.gate_up_proj": "colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                      "layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.shared_experts.gate_proj": "colwise",
                      "layers.*.mlp.shared_experts.up_proj": "colwise",
                      "layers.*.mlp.shared_experts.down_proj": "rowwise", "layers.*.mlp.shared_experts": "all_reduce",
                      "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                      "layers.*.mlp.down_proj": "rowwise"}, "as declared"),
    "longcat_flash": ({"layers.*.self_attn.*.q_b_proj": "colwise",
                       "layers.*.self_attn.*.kv_a_proj_with_mqa": "mla_kv_a_proj",
                       "layers.*.self_attn.*.kv_b_proj": "colwise", "layers.*.self_attn.*.o_proj": "rowwise",
                       "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                       "layers.*.mlp.experts.down_proj": "rowwise",
                       "layers.*.mlp.experts.identity_expert": "moe_identity_expert",
                       "layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlps.*.gate_proj": "colwise",
                       "layers.*.mlps.*.up_proj": "colwise", "layers.*.mlps.*.down_proj": "rowwise"}, None),
    "nemotron_h": ({"embeddings": "embedding_rowwise", "layers.*.mixer.experts.up_proj": "colwise",
                    "layers.*.mixer.experts.down_proj": "rowwise", "layers.*.mixer.experts": "moe_tp_experts"},
                   "as declared"),
}
NEMOTRON_H_525 = {"embeddings": "embedding_rowwise", "layers.*.mixer.q_proj": "colwise",
                  "layers.*.mixer.k_proj": "colwise", "layers.*.mixer.v_proj": "colwise",
                  "layers.*.mixer.o_proj": "rowwise"}


def declared_as(monkeypatch: pytest.MonkeyPatch, family: str, tp_plan: dict[str, str],
                ep_plan: Any = "as declared") -> None:
    """`family`'s config class declaring `tp_plan` (and `ep_plan`, unless "as declared") for this test."""
    config_class = type(transformers.AutoConfig.for_model(family))
    monkeypatch.setattr(config_class, "base_model_tp_plan", tp_plan)
    if ep_plan != "as declared":
        monkeypatch.setattr(config_class, "base_model_ep_plan", ep_plan, raising=False)


def declared_as_524(monkeypatch: pytest.MonkeyPatch, *families: str) -> None:
    for family in families:
        declared_as(monkeypatch, family, *PLANS_524[family])


# shape_of's readings, by what decides them: 110 readings in this file are 68 distinct ones,
# and a reading runs the model (seconds each, the file's largest cost).
_READINGS: dict[tuple[str, ...], Any] = {}


def shape_of(tmp_path: Path, family: str, kept: bool = True, **fields: Any) -> Any:
    """The family's tiny shape as plait reads it; `kept` false: without what autograd keeps (its
    forwards), where a test reads only counts and traffic. Its config.json is written at
    `tmp_path` each time (tests read it again there); the reading is reused where the file, the
    plans the config class declares (`declared_as`) and the size measured on the CPU agree.
    A test of the reading itself (test_the_reading_is_the_same_each_time) reads afresh."""
    from plait.models.hf import load

    config = transformers.AutoConfig.for_model(family, **{**SHAPE, **fields})
    config.save_pretrained(tmp_path)
    plans = tuple(repr(getattr(type(config), name, None)) for name in ("base_model_tp_plan", "base_model_ep_plan"))
    key = ((tmp_path / "config.json").read_text(), str(kept), *plans, str(load.CPU_MEASURED_PARAMS))
    if key not in _READINGS:
        _READINGS[key] = measured_shape(read_hf_dir(f"hf:{tmp_path}"), kept=kept)
    return _READINGS[key]


def test_a_hybrids_blocks_are_read_each(tmp_path: Path) -> None:
    shape = shape_of(tmp_path / "qwen3_next", "qwen3_next", num_hidden_layers=4, **LINEAR, **MOE)
    assert shape.tp_attention and shape.tp_attention_share == 0.25 and shape.tp_attention_entries == 1.5
    assert shape.qk_norm == "head" and shape.qk_norm_share == 0.25
    # in_proj_qkvz (96), in_proj_ba (8), out_proj (32) in three blocks of four
    assert shape.tp_gathered == (3 * (96 + 8 + 32) / 4, 0) and shape.tp_gathered_calls == (9 / 4, 0)
    lara = shape_of(tmp_path / "lara", "lara_mini", num_hidden_layers=4, sliding_window=6, **LINEAR, **MOE)
    assert (lara.tp_attention_share, lara.tp_attention_entries, lara.tp_gathered) == (0.5, 0.5, (16.0, 0))
    olmo = shape_of(tmp_path / "olmo", "olmo_hybrid", pad_token_id=0, layer_types=["linear_attention", "full_attention"],
                    **LINEAR)
    assert (olmo.tp_attention_share, olmo.tp_attention_entries, olmo.qk_norm, olmo.qk_norm_share) == (0.5, 0, "full", 0.5)


def test_a_dense_models_blocks_read_as_one(tmp_path: Path) -> None:
    shape = shape_of(tmp_path, "qwen3")
    assert (shape.tp_attention_share, shape.tp_attention_entries, shape.qk_norm_share, shape.tp_gathered) == \
        (1.0, 0.0, 1.0, (0, 0))


def test_wider_global_heads_norm_more(tmp_path: Path) -> None:
    shape = shape_of(tmp_path, "gemma4_unified_text", sliding_window=6, global_head_dim=16)
    assert shape.qk_norm == "head" and shape.qk_norm_share == (8 + 16) / 8 / 2


def test_the_indexer_has_no_gradient_to_sum(tmp_path: Path) -> None:
    shape = shape_of(tmp_path, "deepseek_v32", **MLA)
    # q_a_proj 16 x 32, its norm 16, kv_a_proj_with_mqa 24 x 32 (16 + the rotary key's 8), its norm 16
    assert shape.tp_entered_tail == 8 and shape.mla_down_params == 16 * 32 + 16 + 24 * 32 + 16


def test_mla_enters_with_its_latents_widths(tmp_path: Path) -> None:
    """Under tp each column layer reading a latent enters the attention on its own, as wide as
    the latent: DeepSeek-V3.2's q_b_proj and kv_b_proj read 16 each where the hidden is 32 (no
    layer reads the hidden: SP's gathered input is kept by the down-projections alone);
    HY-V4's gate_proj reads the hidden beside them (32 more a token, and SP gathers its input
    again in backward); AXK2's q_gate_proj reads both q latents, 2 x 12; dots3 sums the norm of
    its rotary key (8 weights) as its plan declares. AXK2's norms hold a gate MLP each, which SP
    sums with the norms (sp_norm_extra, a block's mean)."""
    v32 = shape_of(tmp_path / "v32", "deepseek_v32", **MLA)
    assert (v32.tp_entry_extra, v32.attention_reads_input, v32.tp_summed_params) == (0, False, 0)
    hy = shape_of(tmp_path / "hy", "hy_v4", **MLA, pad_token_id=0)
    assert (hy.tp_entry_extra, hy.attention_reads_input) == (16 + 16 + 32 - 32, True)
    axk2 = shape_of(tmp_path / "axk2", "axk2", **{**MLA, "q_lora_rank": 12})
    assert (axk2.tp_entry_extra, axk2.attention_reads_input) == (2 * 12 + 16 - 32, False)
    # its gated norms (a 32-wide norm, fc1 16 x 32, fc2 32 x 16): the dense block's input norm,
    # both of the MoE block's; the first block's plain post-attention norm is norm_params' one
    gated = 32 + 2 * 16 * 32
    assert axk2.norm_params == 1 and axk2.sp_norm_extra == (gated + 32 + 2 * gated) / 2 - 32
    dots3 = shape_of(tmp_path / "dots3", "dots3_note_text", **MLA, pad_token_id=0, sliding_window=6)
    assert (dots3.tp_summed_params, dots3.attention_reads_input) == (8, True)


def test_the_attentions_heads_are_read_as_it_is_handed_them(tmp_path: Path) -> None:
    """K/V heads and widths are read off what the attention function is handed, where
    config.json's word is not the model's: GPT-NeoX and OPT run every head whatever
    num_key_value_heads says, GPT-BigCode's multi-query attention one (kept whole under tp, so
    tp 2 is no reason to refuse it), DeepSeek-V3's latent attention q and K 16 wide, V 8, and
    DiffLlama calls it twice a layer. OPT's learned positions (64 here) are shorter than the
    lengths its blocks were measured at, which failed: they are now measured within them, where
    the formulas stood."""
    for family in ("gpt_neox", "opt"):
        shape = shape_of(tmp_path / family, family)
        assert (shape.n_kv_heads, shape.head_widths) == (4, ()), family
        assert shape.block_saved_bytes, family
    bigcode = shape_of(tmp_path / "bigcode", "gpt_bigcode", multi_query=True)
    assert (bigcode.n_kv_heads, bigcode.tp_attention) == (1, False)
    bigcode.check_split(2)
    llama = shape_of(tmp_path / "llama", "llama")
    assert (llama.n_kv_heads, llama.head_widths, llama.attention_widths) == (2, (), (32, 16, 16, 32))
    mla = shape_of(tmp_path / "v3", "deepseek_v3", **MLA)
    assert (mla.n_kv_heads, mla.head_widths, mla.attention_widths) == (4, (16, 16, 8), (64, 64, 32, 32))
    # DiffLlama's differential attention calls the attention twice a layer: cp sends K/V twice
    diff = shape_of(tmp_path / "diff", "diffllama")
    assert (diff.attention_calls, llama.attention_calls, mla.attention_calls) == (2, 1, 1)
    one, twice = (context_layer_bytes(shape, Workload(cp=2, micro_batch=2, seq_len=16)) for shape in (llama, diff))
    assert twice == {way: 2 * one[way] for way in one}
    # counts alone (no forward): the config's word
    assert shape_of(tmp_path / "neox-counts", "gpt_neox", kept=False).n_kv_heads == 2


def test_a_models_capped_logits_are_kept_on_the_last_stage(tmp_path: Path) -> None:
    """nanochat's forward caps its logits, c·tanh(logits / c) (final_logit_softcapping, as
    Gemma 2's and 3's): tanh keeps them for backward, b·s·V in the compute dtype, which autograd
    measures and the estimate holds on the last stage alone (the ledger sweep's nanochat, one
    process: 0.79 of measured before, 1.006 after; Gemma 2 0.87, now 0.9995)."""
    from plait.estimate.activations import stage_activation_bytes

    capped = shape_of(tmp_path / "capped", "nanochat", final_logit_softcapping=15.0)
    plain = shape_of(tmp_path / "plain", "nanochat", final_logit_softcapping=None)
    assert (capped.logit_softcap, plain.logit_softcap) == (True, False)
    kept = {name: saved_by_autograd(tmp_path / name, torch.float32, 2, 16) for name in ("capped", "plain")}
    assert kept["capped"] - kept["plain"] == 2 * 16 * 128 * 4
    one = Workload(micro_batch=2, seq_len=16)
    (stage,) = layout_stages(capped, one)
    assert stage_activation_bytes(capped, one, stage) - stage_activation_bytes(plain, one, stage) == 2 * 16 * 128 * 4
    pp = Workload(micro_batch=2, seq_len=16, pp=2, grad_accum=2)
    first, last = layout_stages(capped, pp)
    assert stage_activation_bytes(capped, pp, first) == stage_activation_bytes(plain, pp, first)
    assert stage_activation_bytes(capped, pp, last) > stage_activation_bytes(plain, pp, last)


def test_gpt2s_blocks_keep_what_autograd_keeps(tmp_path: Path) -> None:
    """GPT-2's blocks are measured as any family's (its attention and MLP the regions its
    adapter splits): the estimate of one process holds what autograd keeps within 1%, where
    the Korthikanti formula its arch names gave 0.75 (transformers' gelu_new keeps four tensors
    of the MLP's width, the formula one)."""
    from plait.estimate.activations import stage_activation_bytes

    quiet = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    shape = shape_of(tmp_path / "gpt2", "gpt2", **quiet)
    assert shape.arch == "gpt2" and shape.block_saved_bytes
    layout = Workload(micro_batch=2, seq_len=16)
    (stage,) = layout_stages(shape, layout)
    kept = saved_by_autograd(tmp_path / "gpt2", torch.float32, 2, 16)
    assert abs(stage_activation_bytes(shape, layout, stage) / kept - 1) < 0.01
    formula = stage_activation_bytes(replace(shape, block_saved_bytes=()), layout, stage)
    assert formula / kept < 0.8


def test_an_mlp_is_read_as_its_weights_say(tmp_path: Path) -> None:
    """LFM2 sizes its MLP (`feed_forward`) from block_ff_dim, not intermediate_size: 256 wide
    here, whose whole weights SP sums; MiniMax-M3's dense first block is read once the MoE
    blocks are known (dense_intermediate_size, 64); MPT's `ffn` is two matrices and adds the
    residual it is given, so SP reads it whole."""
    lfm2 = shape_of(tmp_path / "lfm2", "lfm2", layer_types=["conv", "full_attention"])
    assert (lfm2.ffn_hidden, lfm2.mlp_matrices, lfm2.tp_mlp) == (256, 3, False)
    m3 = shape_of(tmp_path / "m3", "minimax_m3_vl_text", layer_types=["full_attention", "minimax_m3_sparse"],
                  mlp_layer_types=["dense", "sparse"], num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                  dense_intermediate_size=64, shared_intermediate_size=32, rotary_dim=8, index_n_heads=2,
                  index_head_dim=8, index_block_size=4, index_topk_blocks=2)
    assert (m3.moe_blocks, m3.ffn_hidden, m3.mlp_matrices) == ((1,), 64, 3)
    mpt = shape_of(tmp_path / "mpt", "mpt")
    assert (mpt.mlp_matrices, mpt.sp_mlp_read_whole) == (2, True)
    assert not shape_of(tmp_path / "llama", "llama").sp_mlp_read_whole


def test_shared_experts_beside_the_moe_module(tmp_path: Path) -> None:
    """GraniteMoE-shared keeps its shared MLP in the block, beside the module holding the
    experts: found there (48 wide), its weights summed under SP with the MoE block's."""
    shape = shape_of(tmp_path, "granitemoeshared", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                     shared_intermediate_size=48)
    assert shape.experts == 4 and shape.shared_width == 48


def test_the_routing_counts_and_the_embeddings_unit_are_read_as_training_makes_them(tmp_path: Path) -> None:
    """Training counts a transformers MoE's routing where each block of its ep plan has a router
    to hook (`gate`: Mixtral's; PhiMoE's is named otherwise), and sums the counts over the data
    ranks once a step: (E + 1) int64 numbers a block, priced (GPTConfig.counts_routing). ZeRO-3
    takes an embedding for a unit only when it holds its own parameters alone (Inkling-2's holds
    its norm as a child: in the root, whole), and its peak holds the table then."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.memory import stage_memory, zero3_units
    from plait.estimate.traffic import estimate_comm

    mixtral = shape_of(tmp_path / "mixtral", "mixtral", False, num_local_experts=4, num_experts_per_tok=2)
    phimoe = shape_of(tmp_path / "phimoe", "phimoe", False, num_local_experts=4, num_experts_per_tok=2)
    assert (mixtral.counts_routing, phimoe.counts_routing) == (True, False)
    assert not mixtral.balancing_bias  # plait's own MoE's bias: none in a transformers model
    dp2 = Workload(dp=2, micro_batch=2, seq_len=16, precision="fp32")
    counted = estimate_comm(mixtral, dp2)["dp"]["all_reduce"] - estimate_comm(
        replace(mixtral, counts_routing=False), dp2)["dp"]["all_reduce"]
    assert counted == 2 * (4 + 1) * 8  # 2 blocks: 80 B, one step's sum over 2 ranks

    inkling = shape_of(tmp_path / "inkling", "inkling2_text", False, layer_types=["hybrid_sliding", "hybrid"],
                       n_layers_per_attn_res_block=1, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                       swa_head_dim=8, sliding_window_size=6, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, unpadded_vocab_size=128)
    assert not inkling.embedding_unit and shape_of(tmp_path / "llama", "llama", False).embedding_unit
    zero3 = Workload(dp=2, zero=3, micro_batch=2, seq_len=16, precision="fp32")
    peaks = [stage_memory(s, zero3, layout_stages(s, zero3)[0]).params
             for s in (inkling, replace(inkling, embedding_unit=True))]
    assert peaks[0] - peaks[1] == 128 * 32 * 4  # the table, whole throughout
    # under tp its head sums partial logits: all V rows of h / tp features a rank, its unit so
    # (priced at V x h before, a head's rows whole, which put 16 KiB of Inkling-2-Loop's root light)
    tp2 = Workload(dp=2, tp=2, zero=3, micro_batch=2, seq_len=16, precision="fp32")
    assert inkling.head_sums_logits and zero3_units(inkling, tp2, layout_stages(inkling, tp2)[0])[-1][-1] == 128 * 16


def test_gpt2s_zero3_units_and_a_tied_table_are_read_by_zero3s_own_rule(tmp_path: Path) -> None:
    """GPT-2's learned positions are a ZeRO-3 unit of their own, read by ZeRO-3's rule off the
    model as any family's are (they were written in by hand for GPT-2 alone). A tied table is a
    unit where a pipeline cuts it from its head: the first stage's copy (read as no unit, a
    tied GPT-2 under pp 2 x ZeRO-3 was priced 16 KiB over at the peak, 183,552 B for 167,680)."""
    transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4).save_pretrained(tmp_path)
    gpt2 = measured_shape(read_hf_dir(f"hf:{tmp_path}"), kept=False)
    assert gpt2.edge_units == (64 * 32,) and gpt2.embedding_unit and gpt2.tie_embeddings
    assert not gpt2.vocab_split and not gpt2.embedding_split
    tied = shape_of(tmp_path / "qwen3", "qwen3", False, tie_word_embeddings=True)
    assert tied.tie_embeddings and tied.embedding_unit  # ZeRO-3's edges leave a tied table out: no unit read


def test_a_routers_choices_are_counted_whatever_it_returns_after_them(tmp_path: Path) -> None:
    """plait train hooks each MoE block's router to count its choices (experts.install_routing_stats):
    Mixtral's returns (logits, scores, index), Inkling's a fourth, its shared experts' gammas,
    handed on as they are (the hook took every output for its counter's three arguments, and
    training Inkling failed with a TypeError)."""
    from plait.models.hf.experts import declared_experts, install_routing_stats
    from plait.models.hf.plans import declared

    for family, fields in (("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                           ("inkling_text", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 unpadded_vocab_size=128))):
        transformers.AutoConfig.for_model(family, **{**SHAPE, **fields}).save_pretrained(tmp_path / family)
        config = transformers.AutoConfig.from_pretrained(tmp_path / family)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert install_routing_stats(model, declared_experts(model, declared(model, "ep"))) == 2, family
        assert model(input_ids=torch.randint(0, 128, (2, 8))).logits.shape == (2, 8, 128), family
        counts = [m.plait_routing.take_counts() for m in model.modules() if hasattr(m, "plait_routing")]
        assert [int(c.sum()) for c in counts] == [2 * 8 * 2] * 2, family  # each token's two choices, a block


def test_a_context_named_model_max_length_is_read(tmp_path: Path) -> None:
    """Kimi-Linear's config.json gives its context as model_max_length, no
    max_position_embeddings: read, its shape is estimated (it was refused in one line)."""
    shape = shape_of(tmp_path, "kimi_linear", **{**MLA, **dict(
        layer_types=["linear_attention", "full_attention"], pad_token_id=0, linear_head_dim=8, linear_num_heads=4,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1)})
    assert shape.max_seq_len == 64 and shape.n_layers == 2


def test_the_ends_split_as_the_plan_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedding split by vocabulary only where an entry says so (DBRX's head alone is),
    a head split by its input features sums whole logits (Inkling's: no vocab-parallel
    loss; Inkling-2 keeps its embedding whole too), and a head no entry names is whole beside
    an embedding split (Nemotron-H's, whose config counts its blocks by their kinds alone)."""
    declared_as_524(monkeypatch, "inkling_text", "nemotron_h")
    inkling = dict(layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=4, swa_num_key_value_heads=2,
                   swa_head_dim=8, sliding_window_size=6, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32)
    one = shape_of(tmp_path / "inkling", "inkling_text", **inkling, logits_mup_width_multiplier=1.0, n_shared_experts=1)
    two = shape_of(tmp_path / "inkling2", "inkling2_text", **inkling, n_layers_per_attn_res_block=1,
                   unpadded_vocab_size=128)
    dbrx = shape_of(tmp_path / "dbrx", "dbrx", d_model=32, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                    ffn_config={"hidden_size": 32, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
    llama = shape_of(tmp_path / "llama", "llama")
    nemotron = shape_of(tmp_path / "nemotron_h", "nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"],
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mamba_num_heads=4,
                        mamba_head_dim=16, ssm_state_size=8, n_groups=1)
    ends = [(s.embedding_split, s.vocab_split, s.head_sums_logits) for s in (one, two, dbrx, llama, nemotron)]
    assert ends == [(True, False, True), (False, False, True), (False, True, False), (True, True, False),
                    (True, False, False)]
    assert (nemotron.n_layers, nemotron.moe_blocks, nemotron.attention_share) == (4, (1,), 0.25)
    assert embedding_rows(nemotron, 2) == 64 and vocab_shard(nemotron, 2) == 128
    # Inkling's embedding runs its own norm, split in place with it: 32 weights summed over tp;
    # its shared experts, split, enter with one gate a token (n_shared_experts), routed ones whole
    assert [s.embedding_summed_params for s in (one, two, dbrx, llama)] == [32, 0, 0, 0]
    assert (one.tp_expert_entries, two.tp_expert_entries) == ((0, 1), (0, 0))


def test_split_experts_gradients_of_their_weights_are_priced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each float a split experts module enters with beside the tokens sums its gradient over tp
    once a micro-batch an MoE block: LongCat's routing weights, top-k a token (the wire sweep
    measured 1,024 bytes a step there, and 512 for Inkling's gates, before they were priced)."""
    declared_as_524(monkeypatch, "longcat_flash")
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.traffic import expert_entries, tp_traffic

    shape = shape_of(tmp_path, "longcat_flash", **MLA, ffn_hidden_size=64, expert_ffn_hidden_size=32)
    assert shape.tp_expert_entries == (2, 0)
    tp, sp = (Workload(tp=2, sp=sp, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32") for sp in (False, True))
    assert (expert_entries(shape, tp), expert_entries(shape, sp)) == (2, 0)
    assert expert_entries(shape, replace(tp, ep=2, dp=2)) == 0  # dealt out by ep: whole, nothing entered
    without = replace(shape, tp_expert_entries=(0.0, 0.0))
    added = (tp_traffic(shape, tp, layout_stages(shape, tp)[0])["tp"]["all_reduce"]
             - tp_traffic(without, tp, layout_stages(without, tp)[0])["tp"]["all_reduce"])
    assert added == 2 * 16 * 2 * 4 * 2 * shape.moe_layers  # tokens x top-k x fp32 x micro-batches x MoE blocks


def test_a_mixer_beside_the_attention_is_read_whole(tmp_path: Path) -> None:
    """Falcon-H1 runs a mamba mixer beside its attention in every block, both left whole by
    its plan: under SP each is read whole, one more than the attention's accounting; a hybrid
    whose blocks hold one mixer each (LFM2's convolution or attention) has none more."""
    falcon = shape_of(tmp_path / "falcon", "falcon_h1", mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                      mamba_d_state=16, mamba_chunk_size=8)
    lfm2 = shape_of(tmp_path / "lfm2", "lfm2", layer_types=["conv", "full_attention"])
    assert (falcon.sp_whole_mixers, lfm2.sp_whole_mixers) == (1.0, 0.0)


def meta_model(path: Path) -> torch.nn.Module:
    """The model transformers builds from the config.json at `path`, on the meta device."""
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def meta_params(path: Path) -> int:
    """The parameters of the model transformers builds from the config.json at `path`."""
    return sum(p.numel() for p in meta_model(path).parameters())


def test_the_parameters_are_counted_as_the_model_holds_them(tmp_path: Path) -> None:
    """The estimate's parameters are the model's, where the formulas describe a block only in
    part: a hybrid's linear attention (Qwen3-Next), MLA with its indexer (DeepSeek-V3.2), DBRX's
    experts (read as a dense MLP before), Gemma 4's dense MLP beside its experts and its
    per-layer embeddings. Each block's split is its plan's: Qwen3's is the formula's (whose
    whole part missed its q/k norms), and under SP DeepSeek's MoE blocks are kept whole (their
    shared experts' split undone)."""
    cases = {"qwen3_next": dict(num_hidden_layers=4, **LINEAR, **MOE), "deepseek_v32": MLA,
             "dbrx": dict(d_model=32, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                          ffn_config={"hidden_size": 32, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
             "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
             "qwen3": {}}
    for family, fields in cases.items():
        shape = shape_of(tmp_path / family, family, **fields)
        assert shape.num_params() == meta_params(tmp_path / family), family
    qwen3 = shape_of(tmp_path / "qwen3", "qwen3")
    formula = replace(qwen3, block_tally=(), extra_params=0)
    (split, whole), (split_formula, whole_formula) = block_split(qwen3), block_split(formula)
    assert split == split_formula and whole - whole_formula == 2 * 8  # q_norm and k_norm, which the formula left out
    deepseek = shape_of(tmp_path / "deepseek_v32", "deepseek_v32", **MLA)
    assert block_split(deepseek, sp=True)[0] < block_split(deepseek)[0]
    dbrx = shape_of(tmp_path / "dbrx", "dbrx", **cases["dbrx"])
    assert held_experts(dbrx, 2) == 4 * 3 * 32 * 32 / 2  # its experts dealt out over ep, whole MLPs
    gemma4 = shape_of(tmp_path / "gemma4_text", "gemma4_text", **cases["gemma4_text"])
    assert (gemma4.moe_dense_mlps, deepseek.moe_dense_mlps) == (1, 0)  # DeepSeek's mlp holds its experts


def test_hyper_connections_widen_the_residual_and_sum_under_sp(tmp_path: Path) -> None:
    """DeepSeek-V4 holds hc_mult = 4 hidden-wide streams between blocks, mixed around each
    attention and MLP by hyper-connections (`attn_hc`, `ffn_hc`) that run on the sequence slice
    under SP: their weights are summed with the norms'. Qwen4-Exp holds hc_count."""
    shape = shape_of(tmp_path, "deepseek_v4", **MLA)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    held = sum(p.numel() for name, p in model.named_parameters() if "_hc." in name)  # attn_hc, ffn_hc
    assert shape.residual_streams == 4 and shape.norm_params == 2  # its two plain norms a block
    assert held > 0 and shape.sp_norm_extra == held / shape.n_layers
    # Qwen4-Exp counts its streams as hc_count, its gated residuals named `attn_hyper_connection`:
    # read as one stream, a pipeline's messages had been priced at half what it sends
    qwen4 = shape_of(tmp_path / "qwen4", "qwen4_exp_text", num_hidden_layers=4, **LINEAR, **MOE, indexer_n_heads=2,
                     indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2, hc_count=2,
                     hc_lowrank=8)
    assert qwen4.residual_streams == 2


def test_longcat_runs_two_attentions_and_two_mlps_a_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LongCat's block: two MLA attentions ("self_attn.*.o_proj"), each with its rotary key
    entering, two dense MLPs ("mlps.*") beside an MoE module whose routed top-k experts its plan
    splits by tp (no ep plan): all of them run their collectives under tp."""
    declared_as_524(monkeypatch, "longcat_flash")
    shape = shape_of(tmp_path, "longcat_flash", **MLA, ffn_hidden_size=64, expert_ffn_hidden_size=32)
    assert (shape.tp_attention_share, shape.tp_entered_tail, shape.moe_dense_mlps) == (2, 2 * 8, 2)
    assert shape.tp_routed_split and shape.routed_split_by_tp(1) and not shape.routed_split_by_tp(2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    # both attentions' down-projections and their norms, not what the plan's "self_attn.*." entries split
    down = sum(p.numel() for name, p in model.model.layers[0].self_attn.named_parameters() if "_a_" in name)
    assert shape.mla_down_params == down


def test_every_module_a_plan_splits_is_read_as_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a block keeps inside the modules its tp plan splits is divided by tp. LongCat's plan
    names its two attentions and two MLPs by a wildcard ("self_attn.*.o_proj"): read as the
    first of each alone, the second's keep was each rank's whole, and its estimate under tp 2
    on 2 ranks was 1.13 of the meter's. The experts its plan splits (moe_tp_experts, where it
    declares no ep plan) are split too; Llama 4's, read as each rank's whole, were 1.19."""
    from plait.models.hf.load import _row_regions

    declared_as_524(monkeypatch, "longcat_flash")
    shape_of(tmp_path, "longcat_flash", kept=False, **MLA, ffn_hidden_size=64, expert_ffn_hidden_size=32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    block = model.model.layers[0]
    plan = {key[len("layers.*."):]: style for key, style in model.config.base_model_tp_plan.items()}
    regions = _row_regions(block, plan)
    assert sorted(map(id, regions)) == sorted(map(id, (*block.self_attn, *block.mlps, block.mlp.experts)))
    assert block.mlp.experts not in _row_regions(block, plan, experts_split=False)


def test_a_row_layer_alone_in_its_module_leaves_the_module_whole(tmp_path: Path) -> None:
    """Qwen4-Exp's hyper connections hold one row layer that takes its slice of a whole input
    ("rowwise_split_input") and no column layer: the module around it runs whole on every rank.
    Read as a split region, its estimate under tp 2 was 0.958 of the meter's (0.982 now); its
    shared expert, a row layer fed by column layers, stays split."""
    from plait.models.hf.load import _row_regions, _whole_parents
    from tests.worlds.hf_sweep_world import family_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config("qwen4_exp_text"))
    block = model.model.layers[0]
    plan = {key[len("layers.*."):]: style for key, style in model.config.base_model_tp_plan.items()
            if key.startswith("layers.*.")}
    regions = _row_regions(block, plan)
    assert [id(r) for r in regions] == [id(block.mlp.shared_expert)]
    whole = _whole_parents(block, plan)
    assert sorted(map(id, whole)) == sorted(map(id, (block.attn_hyper_connection, block.mlp_hyper_connection)))


def nemotron_blocks(tmp_path: Path) -> tuple[Any, list[int], int]:
    """Nemotron-H's shape with one block of each kind (mamba, MoE, attention, MLP), as its
    config class declares its plan: each block's mixer's parameters, and all its norms'."""
    shape = shape_of(tmp_path, "nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"],
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mamba_num_heads=4,
                     mamba_head_dim=16, ssm_state_size=8, n_groups=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    blocks = model.model.layers
    mixer = [sum(p.numel() for p in block.mixer.parameters()) for block in blocks]
    return shape, mixer, sum(block.norm.weight.numel() for block in blocks)


def test_blocks_of_one_kind_each_sum_what_they_hold_under_sp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron-H's blocks are a mamba mixer, an MoE, an attention and an MLP, each alone, and its
    plan splits nothing in them: under SP the mamba and the attention are read whole (gathered,
    their gradients alike on every rank), the MoE and the MLP run on the slice, their gradients
    summed with the norms'. The estimate gathers for two blocks, not four, and sums those
    parameters, counted from the model (the sweep measured both: 6 gathers a micro-batch where
    the mean block said 10, and 58 KB of sums where it said 128)."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.traffic import counted_sp_sum

    declared_as_524(monkeypatch, "nemotron_h")
    shape, mixer, norms = nemotron_blocks(tmp_path)
    assert shape.sp_whole_mixers == -0.5  # two blocks of four mix no tokens: nothing to read whole there
    assert shape.sp_read_whole == (mixer[0], 0, mixer[2], 0)
    layout = Workload(tp=2, sp=True, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32")
    assert counted_sp_sum(shape, layout, layout_stages(shape, layout)[0]) == mixer[1] + mixer[3] + norms
    llama = shape_of(tmp_path / "llama", "llama")
    assert counted_sp_sum(llama, layout, layout_stages(llama, layout)[0]) is None  # its plan splits its blocks


def test_an_attention_split_by_its_projections_names_beside_whole_blocks(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.25 splits Nemotron-H's attention by its projections' names under a child
    called "mixer", as its mamba, MoE and MLP blocks call theirs: the attention is read as one
    (a quarter of the blocks), the mamba alone read whole under SP, and SP sums what the
    blocks hold less what it splits: the same parameters as where nothing was split, the
    attention's projections now split, not read whole (the sweep had measured 24,576 bytes of
    all-reduce under tp where the estimate said 57,344, reading the attention as an MLP)."""
    from plait.estimate.traffic import counted_sp_sum, sp_blocks_whole

    declared_as(monkeypatch, "nemotron_h", NEMOTRON_H_525)
    shape, mixer, norms = nemotron_blocks(tmp_path)
    assert (shape.tp_attention, shape.tp_attention_share, shape.tp_mlp) == (True, 0.25, False)
    assert shape.sp_read_whole == (mixer[0], 0, 0, 0) and shape.sp_read_whole_count == (1, 0, 0, 0)
    layout = Workload(tp=2, sp=True, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32")
    assert counted_sp_sum(shape, layout, layout_stages(shape, layout)[0]) == mixer[1] + mixer[3] + norms
    assert not sp_blocks_whole(shape, layout)


def test_a_child_read_whole_handing_on_its_residual_gathers_its_gradient(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """DBRX's norm-attention-norm returns (residual, output), both over the whole sequence: under
    SP, read whole, it leaves keeping this rank's chunk of each, and each chunk's gradient is
    gathered back. The shape reader runs the model on meta to see it (the signature does not
    say), one more gather a block, twice in full recompute's rerun only for inputs (the sweep
    measured 8 gathers a micro-batch where the estimate said 6). A child taking one tensor and
    returning one (Nemotron-H's attention) adds nothing."""
    declared_as_524(monkeypatch, "nemotron_h")
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.traffic import tp_traffic

    shape = shape_of(tmp_path, "dbrx", d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                     ffn_config={"hidden_size": 32, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
    assert shape.sp_read_whole_count == (1, 1) and shape.sp_read_whole_passes == ((0.0, 1.0), (0.0, 1.0))
    act = 2 * 16 * 32 * 4  # b·s·h in fp32
    for recompute, per_block in (("none", 3), ("full", 4)):
        layout = Workload(tp=2, sp=True, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32", recompute=recompute)
        ops = tp_traffic(shape, layout, layout_stages(shape, layout)[0])["tp"]
        # a micro-batch: the wrapper's input in (again in the rerun), its two outputs' gradients
        # back, in each of 2 blocks; the sequence's ends (2); half of each on the wire over 2 ranks
        assert ops["all_gather"] == 2 * (2 * per_block + 2) * act / 2, recompute
    nemotron = shape_of(tmp_path / "nemotron", "nemotron_h", layers_block_type=["mamba", "attention"],
                        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1)
    assert nemotron.sp_read_whole_count == (1, 1) and nemotron.sp_read_whole_passes == ((0.0, 0.0), (0.0, 0.0))


def test_blocks_holding_experts_kept_whole_read_their_attention_whole_under_sp(tmp_path: Path) -> None:
    """Gemma 4's blocks hold its experts beside everything else, and its ep plan keeps them whole:
    under SP nothing in such a block is split, so it reads its attention whole (two gathers),
    reduce-scatters nothing and sums every other gradient, and each block's slice of its
    per-layer inputs has its gradient gathered back (the sweep measured 26,624 bytes of gathers
    and no reduce-scatter a step, where the estimate said 32,768 and 16,384)."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.traffic import counted_sp_sum, tp_traffic

    shape = shape_of(tmp_path, "gemma4_text", vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                     sliding_window=6, global_head_dim=16, enable_moe_block=True, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    attention = [sum(p.numel() for p in block.self_attn.parameters()) for block in model.model.layers]
    assert shape.sp_read_whole == tuple(attention) and shape.sp_read_whole_count == (1, 1)
    assert shape.sp_sliced_inputs == 8
    layout = Workload(tp=2, sp=True, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32")
    stage = layout_stages(shape, layout)[0]
    everything = sum(p.numel() for block in model.model.layers for p in block.parameters())
    assert counted_sp_sum(shape, layout, stage) == everything - sum(attention)
    ops = tp_traffic(shape, layout, stage)["tp"]
    assert "reduce_scatter" not in ops
    tokens, act = 2 * 16, 2 * 16 * 32 * 4
    # a micro-batch: each block's attention (2) and the sequence's ends (2), hidden-wide; each
    # block's per-layer inputs, 8 wide: half of each on the wire over 2 ranks
    assert ops["all_gather"] == 2 * ((2 * 2 + 2) * act + 2 * tokens * 8 * 4) / 2


def test_a_layer_after_the_blocks_split_by_its_input(tmp_path: Path) -> None:
    """Qwen4-Exp mixes its hyper-connection streams after the blocks (`hyper_connection_mixer`,
    on the last stage), its down-projection split by its input features: each tp rank holds half
    of its 64 x 8 weights, sums its 8 outputs a token forward and gathers its 64 inputs' gradient
    (the sweep measured 2,048 and 8,192 bytes a step more than the estimate before)."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.traffic import tp_traffic

    shape = shape_of(tmp_path, "qwen4_exp_text", **LINEAR, num_hidden_layers=4, num_experts=4,
                     shared_expert_intermediate_size=48, num_experts_per_tok=2, moe_intermediate_size=32,
                     indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                     indexer_compress_ratio=2, hc_count=2, hc_lowrank=8)
    assert (shape.extra_last_split, shape.tp_last_rows) == (64 * 8, (8, 64))
    layout = Workload(tp=2, pp=2, micro_batch=2, grad_accum=2, seq_len=16, precision="fp32")
    first, last = layout_stages(shape, layout)
    without = replace(shape, extra_last_split=0, tp_last_rows=(0, 0))
    assert layout_stages(without, layout)[1].params - last.params == 64 * 8 // 2
    assert layout_stages(without, layout)[0].params == first.params  # the first stage holds none of it
    ops, before = (tp_traffic(s, layout, layout_stages(s, layout)[1])["tp"] for s in (shape, without))
    tokens = 2 * 16
    assert ops["all_reduce"] - before["all_reduce"] == tokens * 8 * 4 * 2  # fp32, two micro-batches
    assert ops["all_gather"] - before.get("all_gather", 0) == tokens * 64 * 4 * 2 / 2  # (n - 1) / n of it on the wire


def test_zero3_gathers_a_layer_after_the_blocks_on_the_last_stage_at_its_tp_share(tmp_path: Path) -> None:
    """Qwen4-Exp's hyper-connection mixer is two ZeRO-3 units of its own (shard.edge_units), run
    after the blocks on the last stage, its down-projection split by tp (its up-projection whole).
    Taken for units before the blocks, whole, the estimate put `plait train --zero 3`'s peak 1 KiB
    a rank under under tp 2 (the root short the split half) and 4 KiB over under pp 2 (the first
    stage's root short of units it does not hold, the last stage's holding them whole)."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.memory import zero3_units

    shape = shape_of(tmp_path, "qwen4_exp_text", **LINEAR, num_hidden_layers=4, num_experts=4,
                     shared_expert_intermediate_size=48, num_experts_per_tok=2, moe_intermediate_size=32,
                     indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                     indexer_compress_ratio=2, hc_count=2, hc_lowrank=8)
    assert (shape.edge_units, shape.edge_units_last) == ((), ((0, 8 * 64), (64 * 8, 0)))
    for pp, tp in ((1, 2), (2, 1), (2, 2)):
        layout = Workload(tp=tp, pp=pp, zero=3, micro_batch=2, seq_len=16, precision="fp32")
        stages = layout_stages(shape, layout)
        first, last = zero3_units(shape, layout, stages[0])[0], zero3_units(shape, layout, stages[-1])[0]
        head = shape.vocab_size * shape.d_model // tp  # untied, split by vocabulary
        assert last[-3:] == [8 * 64 // tp, 64 * 8, head], (pp, tp)
        if pp > 1:  # the first stage runs the table and its blocks, none of the mixer
            assert first == [shape.vocab_size * shape.d_model // tp, *stages[0].unit_sizes(2, 0)]


# Published totals and active parameters of models whose transformers configs default to them
# (AutoConfig.for_model(family) with no fields), each counted on the meta device: (family, total,
# active per token, in billions, or None where the source's convention is not the count's, and
# the source).
PUBLISHED = [
    ("deepseek_v3", 671, 37, "DeepSeek-V3 Technical Report (arXiv:2412.19437), abstract: 671B total, 37B activated"),
    ("mixtral", 47, 13, "Mixtral of Experts (arXiv:2401.04088), section 2: 47B parameters, 13B active"),
    ("jamba", 52, 12, "Jamba (arXiv:2403.19887), section 3: 12B active parameters out of 52B"),
    ("qwen3_next", 80, None, "Qwen3-Next-80B-A3B model card: 80B in total (its 3B active leave out the embeddings)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, total, active, source", PUBLISHED)
def test_published_models_are_counted_as_published(tmp_path: Path, family: str, total: float, active: float | None,
                                                   source: str) -> None:
    """The count against each model's own figures, within 1% (total) and 2% (active): the
    formulas alone put Jamba's active parameters 14% under its 12B (its mamba layers priced as
    attention), DeepSeek-V3's 4.5% over its 37B (MLA priced as q, k, v, o), Qwen3-Next's total
    1.8% under its 80B."""
    transformers.AutoConfig.for_model(family).save_pretrained(tmp_path)
    shape = measured_shape(read_hf_dir(f"hf:{tmp_path}"), kept=False)  # counts only: no activations' forwards
    assert shape.num_params() == meta_params(tmp_path)
    assert abs(shape.num_params() / 1e9 / total - 1) < 0.01, source
    if active is not None:
        assert abs(shape.active_params() / 1e9 / active - 1) < 0.02, source


def saved_by_autograd(path: Path, dtype: torch.dtype, batch: int, seq: int) -> int:
    """Bytes autograd keeps after one forward of the model at `path`, built with values on the
    CPU from its seed: each storage once, the parameters' and buffers' not, what a branch nothing reads
    saved (and freed) not."""
    return sum(saved_by_where(path, dtype, batch, seq).values())


def saved_by_where(path: Path, dtype: torch.dtype, batch: int, seq: int) -> dict[int, int]:
    """`saved_by_autograd`'s bytes by where they were first saved: in block i (i), or outside the
    blocks (-1)."""
    config = transformers.AutoConfig.from_pretrained(path)
    config.use_cache = False  # as training runs it: no key/value cache
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()
    remake_gated_products(model)  # as plait builds it (plait/models/hf/load.build_hf_model)
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}  # resident, as the meter's
    layers = next((m for m in model.modules()  # none found (HRM's two stacks): all outside
                   if isinstance(m, torch.nn.ModuleList) and len(m) == getattr(config, "num_hidden_layers", -1)), [])
    where = [-1]
    hooks = [hook for i, block in enumerate(layers) for hook in (
        block.register_forward_pre_hook(lambda *_, i=i: where.__setitem__(0, i)),
        block.register_forward_hook(lambda *_: where.__setitem__(0, -1)))]
    saved: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        alias = tensor.detach()  # handed back itself, a tensor saved as its op's output would never be freed
        saved.append((weakref.ref(alias), where[0]))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(input_ids=torch.randint(0, config.vocab_size, (batch, seq)))
    for hook in hooks:
        hook.remove()
    kept: dict[int, tuple[int, int]] = {}
    for tensor, index in ((ref(), index) for ref, index in saved):
        if tensor is not None and tensor.untyped_storage().data_ptr() not in params:
            kept.setdefault(tensor.untyped_storage().data_ptr(), (tensor.untyped_storage().nbytes(), index))
    del output
    by_where: dict[int, int] = {}
    for size, index in kept.values():
        by_where[index] = by_where.get(index, 0) + size
    return by_where


def test_an_eager_attention_keeps_its_matrices(tmp_path: Path) -> None:
    """Gemma 2's soft-capped attention and BLOOM's ALiBi run eagerly (transformers' choice):
    each keeps s × s matrices for backward, which the estimate prices from what a forward on
    meta keeps (attention_matrix_bytes), held here to what autograd keeps on the CPU, as the
    s² term of two sequence lengths, in fp32 and bf16; Llama's SDPA keeps none."""
    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import Workload, layout_stages

    def quadratic(measure: Any) -> float:  # the s² term of a measure at 32 and 64 tokens
        return (measure(64) - 2 * measure(32)) / (64 * 64 - 2 * 32 * 32)

    cases = {"gemma2": {}, "bloom": dict(n_layer=2, n_head=4), "llama": {}}
    for family, fields in cases.items():
        shape = shape_of(tmp_path / family, family, **fields)
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            def estimated(seq: int) -> float:
                layout = Workload(micro_batch=2, seq_len=seq, precision=precision)
                return stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])

            measured = quadratic(lambda seq: saved_by_autograd(tmp_path / family, dtype, 2, seq))
            if family == "llama":
                assert shape.attention_matrix_bytes == (0, 0) and measured == 0
            else:
                assert measured > 0 and abs(quadratic(estimated) / measured - 1) < 0.1, (family, precision)


def test_a_hybrids_attention_flops_are_its_attention_blocks(tmp_path: Path) -> None:
    """The attention's FLOPs (4·h·s a token forward a block) count the blocks whose config's
    layer_types name softmax attention: Qwen3-Next's one in four, LFM2's one in two (beside a
    convolution), none of Mamba's; every block of Llama's."""
    from plait.estimate.time import flops_per_token

    shapes = {"qwen3_next": shape_of(tmp_path / "qwen3_next", "qwen3_next", num_hidden_layers=4, **LINEAR, **MOE),
              "lfm2": shape_of(tmp_path / "lfm2", "lfm2", layer_types=["conv", "full_attention"]),
              "mamba": shape_of(tmp_path / "mamba", "mamba"),
              "llama": shape_of(tmp_path / "llama", "llama")}
    assert {family: shape.attention_share for family, shape in shapes.items()} == \
        {"qwen3_next": 0.25, "lfm2": 0.5, "mamba": 0.0, "llama": 1.0}
    for family, shape in shapes.items():  # the s-linear term of the model's FLOPs a token
        attention = flops_per_token(shape, 64)[0] - flops_per_token(shape, 32)[0]
        assert attention == 12 * shape.n_layers * shape.attention_share * shape.d_model * 32, family


def test_the_attentions_flops_are_what_its_products_count(tmp_path: Path) -> None:
    """The attention core's FLOPs (ops.attention_core_flops: the model's FLOPs a token and the
    attention's time both read it) against torch's FLOP counter over the model's own forward,
    its term in s²: 2·(w_q + w_o) a query a key a block. Llama's 4·h; a head_dim that is not
    hidden / heads (Qwen3's kind: q and the output twice as wide as h here); DeepSeek-V3's latent
    attention (q 16 wide a head, its output 8); DiffLlama's two calls a layer; GPT-NeoX's."""
    from torch.utils.flop_counter import FlopCounterMode

    from plait.estimate.ops import attention_core_flops

    cases = {"llama": ("llama", {}), "qwen3": ("qwen3", {"head_dim": 16}), "v3": ("deepseek_v3", MLA),
             "diff": ("diffllama", {}), "neox": ("gpt_neox", {})}
    counted = {}
    for name, (family, fields) in cases.items():
        shape = shape_of(tmp_path / name, family, **fields)
        config = transformers.AutoConfig.from_pretrained(tmp_path / name)
        # eager: its products are matmuls the counter counts (it does not count SDPA's CPU kernel)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")

        def forward_flops(seq: int) -> int:
            with FlopCounterMode(display=False) as counter, torch.no_grad():
                model(input_ids=torch.zeros(1, seq, dtype=torch.long))
            return counter.get_total_flops()

        s = 16  # F(s) = a·s + c·s²: F(2s) - 2·F(s) = 2·c·s²
        measured = (forward_flops(2 * s) - 2 * forward_flops(s)) / (2 * s * s)
        counted[name] = measured / shape.n_layers
        assert measured == attention_core_flops(shape, 1, 1) * shape.n_layers, name
    assert counted == {"llama": 128, "qwen3": 256, "v3": 192, "diff": 256, "neox": 128}


JAMBA = dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, attn_layer_offset=1, attn_layer_period=2,
             expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_expand=2)


def s_term(measure: Any) -> float:
    """The s term of c + a·s + q·s² measured at 64, 128 and 192 tokens."""
    k = [measure(n) for n in (64, 128, 192)]
    return (k[1] - k[0] - 3 * (k[2] - 2 * k[1] + k[0]) / 2) / 64


def test_the_activations_are_what_autograd_keeps_to_the_byte(tmp_path: Path) -> None:
    """Llama, Qwen3's kind (a head_dim that is not hidden / heads), OLMo2, Phi, GPT-NeoX and
    Persimmon: the estimate of one process equals what autograd keeps after a forward, to the
    byte, at one sequence and two, in fp32 and bf16. Three readings made it so:
    - the blocks are measured without a key/value cache, as training runs: a cache copies K
      and V, which GPT-NeoX and Persimmon hand their attention as views of one fused
      projection (their activations were 0.90 and 1.09 of autograd's keep);
    - the final norm is measured as it is (Persimmon's LayerNorm was priced as an RMSNorm,
      4 bytes more a value in fp32);
    - the rotary tables are counted once a forward, one sequence's rows shared by the batch:
      counted a token, two sequences kept a sequence's rows too many."""
    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import Workload, layout_stages

    cases = {"llama": {}, "qwen3": dict(head_dim=16), "olmo2": {}, "phi": {}, "gpt_neox": {}, "persimmon": {}}
    for family, fields in cases.items():
        shape = shape_of(tmp_path / family, family, **fields)
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for batch in (1, 2):
                layout = Workload(micro_batch=batch, seq_len=32, precision=precision)
                estimated = stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])
                kept = saved_by_autograd(tmp_path / family, dtype, batch, 32)
                assert estimated == kept, (family, precision, batch, estimated / kept)


def test_the_copy_of_sdpas_output_cp_spares_is_read_apart(tmp_path: Path) -> None:
    """Context parallelism replaces the model's attention, so the copy of SDPA's output a block
    makes for o_proj is read apart (attention_out_copy_bytes, a token a block, fp32 then bf16;
    h = 32 here): GPT-NeoX, Persimmon and Phi take their heads out of one projection and get
    them back head-major, h values copied; Llama gets them back sequence-major, and o_proj reads
    a view. The ring and Ulysses hand theirs back sequence-major: no copy, and the activations
    under ring cp 2 equal the run's meter for these families (benchmarks/RESULTS.md)."""
    from plait.estimate.activations import o_proj_copy_values

    expected = {"llama": 0, "gpt_neox": 32, "persimmon": 32, "phi": 32}
    for family, copied in expected.items():
        shape = shape_of(tmp_path / family, family)
        assert shape.attention_out_copy_bytes == (4 * copied, 2 * copied), family
        assert o_proj_copy_values(shape, Workload()) == copied, family
        assert o_proj_copy_values(shape, Workload(cp=2, seq_len=16)) == 0, family


def test_the_kv_heads_repeated_for_sdpa_cp_spares_are_read_apart(tmp_path: Path) -> None:
    """transformers hands SDPA grouped K/V heads only without a mask: Mistral's sliding window
    (6 tokens, shorter than the measured lengths) makes one, and its layers keep K and V
    repeated from 2 heads to 4, (4 - 2) x (8 + 8) values a token beyond the grouped ones
    (kv_repeat_bytes, fp32 then bf16); Llama's, unmasked, none. Context parallelism's attention
    is handed them grouped: nothing repeated under cp, and Mistral's activations under ring cp 2
    equal the run's meter (benchmarks/RESULTS.md)."""
    from plait.estimate.activations import kv_repeat_values

    for family, fields, repeated in (("llama", {}, 0), ("mistral", {"sliding_window": 6}, 32)):
        shape = shape_of(tmp_path / family, family, **fields)
        assert shape.kv_repeat_bytes == (4 * repeated, 2 * repeated), family
        assert kv_repeat_values(shape, Workload()) == repeated, family
        assert kv_repeat_values(shape, Workload(cp=2, seq_len=16)) == 0, family


def test_what_sdpas_inputs_keep_and_who_keeps_its_output_are_read_apart(tmp_path: Path) -> None:
    """Ulysses hands its attention q, k and V of its own, traded by all-to-alls, and hands the
    output back as a tensor of its own; at one process the model's own tensors stood there.
    - GPT-NeoX and Phi-3 hand SDPA a V that slices one fused q|k|v projection's output nothing
      else keeps: SDPA keeping V keeps it all, q's and k's values beside (2 × 32 a token,
      32 + 16 for Phi-3's two K/V heads), which Ulysses frees.
    - Persimmon's V slices an output its q and k norms keep anyway: at one process it costs
      nothing of its own, under Ulysses its 32 values (GPTConfig.qkv_view_bytes, signed).
    - o_proj keeps the attention's output (Llama a view, GPT-NeoX a copy), and under Ulysses
      the output traded back; JetMoE's mixture of output heads keeps its own gathered pieces
      instead, and keeps no traded-back output (GPTConfig.attention_out_kept).
    Under Ulysses the blocks' bytes move by exactly these (GPT-NeoX, Phi-3, Persimmon and JetMoE
    were 1.15, 1.075, 0.944 and 1.023 of the run's meter); the ring, which keeps the local V, and
    one process do not."""
    from plait.estimate.activations import llama_layer_bytes, measured_correction

    for family, beyond, read in (("gpt_neox", 64, 1.0), ("phi3", 48, 1.0), ("persimmon", -32, 1.0),
                                 ("jetmoe", 0, 0.0), ("llama", 0, 1.0)):
        shape = sweep_family(tmp_path / family, family)
        assert shape.qkv_view_bytes == (4 * beyond, 2 * beyond), family
        assert shape.attention_out_kept == read, family
        plain, ring, ulysses = (measured_correction(shape, Workload(cp=cp, cp_kind=kind, seq_len=16))
                                for cp, kind in ((1, "ring"), (2, "ring"), (2, "ulysses")))
        assert plain == ring and ulysses[1] == plain[1] - 4 * beyond, family
        with_read, without = (llama_layer_bytes(replace(shape, attention_out_kept=kept),
                                                Workload(cp=2, cp_kind="ulysses", seq_len=16, micro_batch=2))
                              for kept in (1.0, 0.0))
        assert with_read - without == 4 * 32 * 16, family  # h values a token of the traded-back output


def test_a_sliding_windows_mask_and_repeated_heads_are_what_autograd_keeps(tmp_path: Path) -> None:
    """Mistral at one process, to the byte, in fp32: where the sequence (16, 32) reaches the
    window (6), transformers hands SDPA a mask, which SDPA keeps as its own additive b·s² copy at
    every layer, and K/V repeated to q's heads; where the window holds it (64), neither. The
    repeated heads are measured at the shape's lengths, past a window of 6 and of 64 alike, and
    priced as each sequence makes them (before: 0.95-0.98 and 1.053 of autograd's keep)."""
    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import Workload, layout_stages

    for window in (6, 64):
        shape = shape_of(tmp_path / f"w{window}", "mistral", sliding_window=window)
        assert shape.sliding_mask_layers == 1.0
        for seq in (16, 32):
            layout = Workload(micro_batch=2, seq_len=seq)
            estimated = stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])
            assert estimated == saved_by_autograd(tmp_path / f"w{window}", torch.float32, 2, seq), (window, seq)


def test_a_window_named_otherwise_is_read_from_the_built_config(tmp_path: Path) -> None:
    """RecurrentGemma names its window attention_window_size (config.json's key; transformers maps
    sliding_window onto it): read from config.json alone it was no window, and the mask its
    attention blocks hand SDPA went unpriced, 0.945-0.972 of autograd's keep. Read from the built
    config, it is to the byte at one and two sequences of 16 to 64 tokens."""
    shape = sweep_family(tmp_path / "recurrent_gemma", "recurrent_gemma")
    assert (shape.sliding_window, shape.sliding_mask_layers) == (6, 0.5)
    for batch, seq in ((1, 16), (2, 16), (1, 64)):
        assert estimate_over_keep(tmp_path / "recurrent_gemma", shape, batch, seq) == pytest.approx(1, abs=1e-6), seq


def sweep_family(path: Path, family: str) -> Any:
    """The family's tiny shape from the transformers sweep's config (tests/worlds/hf_sweep_world.py),
    saved at `path` as the sweep's runs save it (a 256-token vocabulary)."""
    from tests.worlds.hf_sweep_world import family_config

    config = family_config(family)
    config.vocab_size = 256
    config.save_pretrained(path)
    return measured_shape(read_hf_dir(f"hf:{path}"))


def one_process_gap(path: Path, shape: Any) -> list[float]:
    """The estimate of one process less what autograd keeps after a forward, in fp32, at 2 × 16,
    1 × 16 and 2 × 32 tokens."""
    return [one_process_estimate(shape, batch, seq) - saved_by_autograd(path, torch.float32, batch, seq)
            for batch, seq in ((2, 16), (1, 16), (2, 32))]


def one_process_estimate(shape: Any, batch: int, seq: int) -> float:
    """The estimate's activations of one process, in fp32."""
    from plait.estimate.activations import stage_activation_bytes

    layout = Workload(micro_batch=batch, seq_len=seq)
    return stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])


def test_a_batch_keeps_what_its_sequences_keep_together(tmp_path: Path) -> None:
    """A micro-batch of several sequences need not keep that many times one sequence: Jamba's
    mamba keeps its final state once a sequence (read as once a forward from one sequence) and at
    one sequence views a reshape it copies from two up; GPT-NeoX-Japanese keeps less a sequence
    from two up; Inkling 2's relative position bias (s × s) is one for the batch. Read from one
    sequence alone, the estimate was 0.975-0.978 of autograd's keep for Jamba at two to four
    sequences, 1.10 for GPT-NeoX-Japanese and 1.004 for Inkling 2. With forwards of two and
    three sequences (GPTConfig.further_sequence_bytes) each is within 0.05% at one to four
    sequences and two lengths (the first two to the byte); a Llama reads nothing there."""
    for family in ("jamba", "gpt_neox_japanese", "inkling2_text"):
        shape = sweep_family(tmp_path / family, family)
        assert any(shape.further_sequence_bytes[0]), family
        for batch, seq in ((1, 16), (2, 16), (3, 32), (4, 16)):
            assert estimate_over_keep(tmp_path / family, shape, batch, seq) == pytest.approx(1, abs=5e-4), (family, batch)
    assert not any(sweep_family(tmp_path / "llama", "llama").further_sequence_bytes[0])


def test_what_a_model_keeps_outside_its_blocks_is_what_autograd_keeps(tmp_path: Path) -> None:
    """nanochat runs its final norm on the embedding's output too, before the blocks; HRM runs
    one stack's norm between its two stacks: each keeps the norm's input and statistics, 2,112
    bytes a sequence of 16 here that the estimate missed (0.972 and 0.974 of autograd's keep,
    under cp too). Measured outside the blocks (GPTConfig.outside_saved_bytes), both are to the
    byte at one process, and a plain Llama keeps nothing there but its token ids."""
    for family in ("nanochat", "hrm_text"):
        shape = sweep_family(tmp_path / family, family)
        assert shape.outside_saved_bytes == (4 * (32 + 1), 4 * (32 + 1)), family  # h and a statistic, in fp32
        assert one_process_gap(tmp_path / family, shape) == [0, 0, 0], family
    assert sweep_family(tmp_path / "llama", "llama").outside_saved_bytes == (0.0, 0.0)


def test_a_looped_models_runs_and_its_heads_logits_are_what_autograd_keeps(tmp_path: Path) -> None:
    """Dory's head scales each logit by a learned weight, and keeps its fp32 logits for that
    weight's gradient: 1,024 bytes a token at this 256-token vocabulary
    (GPTConfig.head_saved_bytes), in bf16 too. Its loop adds the input's norm again before each
    pass, outside the blocks. Its looped kind runs the recurrent block twice: each run keeps its
    own, so a block's bytes are a mean over the runs (they were over the blocks held: 4/3 of the
    keep) and its sliding windows' masks are those of two runs in four, not two blocks in three.
    Each run also derives small vectors from its weights, 1,536 bytes a run whatever the tokens,
    and the head its scale, 1,024 (GPTConfig.constant_bytes): with them, to the byte."""
    for family, runs in (("dory", 3), ("dory_looped", 4)):
        shape = sweep_family(tmp_path / family, family)
        assert (sum(shape.block_runs) or shape.n_layers) == runs, family
        assert shape.head_saved_bytes == (4 * 256, 4 * 256), family
        assert shape.sliding_mask_layers == (0.5 if runs == 4 else 2 / 3), family
        assert shape.constant_bytes[0][0] == 1536 and shape.constant_bytes[2][0] == 1024, family
        assert one_process_gap(tmp_path / family, shape) == pytest.approx([0] * 3, abs=1e-6), family


def test_what_no_token_makes_is_kept_once_a_forward(tmp_path: Path) -> None:
    """Gemma's and Nemotron's norms make 1 + weight afresh at each call and keep it for backward:
    h values a norm a forward, whatever the tokens (Gemma's embedding scale is a buffer, resident,
    not kept). Left out, the estimate was 640-1,156 bytes under autograd's keep at every length. Priced a
    block's run and at the ends (GPTConfig.constant_bytes), to the byte; a Llama keeps none."""
    for family, per_run in (("gemma", 2 * 128), ("gemma2", 4 * 128), ("nemotron", 2 * 128), ("llama", 0)):
        shape = sweep_family(tmp_path / family, family)
        assert shape.constant_bytes[0][0] == per_run, family  # fp32 (Gemma's norms make 1 + weight in fp32 in bf16 too)
        assert one_process_gap(tmp_path / family, shape) == [0, 0, 0], family


def estimate_over_keep(path: Path, shape: Any, batch: int, seq: int) -> float:
    """The one-process estimate over what autograd keeps after a forward, in fp32."""
    return one_process_estimate(shape, batch, seq) / saved_by_autograd(path, torch.float32, batch, seq)


def test_a_buffer_is_resident_and_a_block_of_lightning_attention_is_read_whole(tmp_path: Path) -> None:
    """MiniMax's lightning attention reads views of its decay tables, buffers (1 MiB of the tiny
    model), which the estimate took for a forward's keep and the meter, rightly, does not: the
    run's activations read 0.24 of the estimate. It works on blocks of 256 tokens (config's
    block_size), keeping each head's block × block scores, so its keep grows with the sequence
    as at full length only from a block up: measured from there, within 2% at one, two and
    four blocks."""
    shape = sweep_family(tmp_path / "minimax", "minimax")
    for batch, seq in ((1, 256), (1, 512), (2, 1024)):
        assert estimate_over_keep(tmp_path / "minimax", shape, batch, seq) == pytest.approx(1, abs=0.02), seq


def test_a_linear_attention_that_pads_to_chunks_is_read_by_the_chunk(tmp_path: Path) -> None:
    """Qwen3-Next's gated delta rule (its torch path) pads the sequence to 64-token chunks and
    keeps a chunk's states whatever the tokens in it. Read as a token's from 64 and 128 tokens,
    its estimate was 0.46 of autograd's keep at 16 tokens, and 1.06 from 128 up (its second
    chunk keeps more than those after it). Read by the chunk (GPTConfig.mixer_chunk: the first,
    the second and each further one, from forwards at 32, 64, 128 and 192 tokens), it is exact
    at one, two and three chunks and within 1% at two sequences of four; a mamba's scan, which
    keeps by the token, reads none."""
    shape = sweep_family(tmp_path / "qwen3_next", "qwen3_next")
    assert shape.mixer_chunk == 64 and len(shape.mixer_chunk_bytes) == 2
    for batch, seq in ((1, 16), (1, 64), (1, 128), (1, 192)):
        assert estimate_over_keep(tmp_path / "qwen3_next", shape, batch, seq) == 1, seq
    assert estimate_over_keep(tmp_path / "qwen3_next", shape, 2, 256) == pytest.approx(1, abs=0.01)
    assert sweep_family(tmp_path / "jamba", "jamba").mixer_chunk == 0


@pytest.mark.parametrize("family", ["glm4_moe", "jamba", "qwen3_next"])
def test_a_pipeline_stage_keeps_its_own_blocks(tmp_path: Path, family: str) -> None:
    """A stage keeps what its own blocks keep. Read as the mean block, the stage of GLM-4-MoE's
    MoE block (its first block is dense, 0.67 of it) was priced at 0.85 of its keep under pp 2
    on 2 ranks, Jamba's mamba stage and Qwen3-Next's stage of padded linear attentions at 0.69
    and 0.80. Each block's keep is read with the mean's (GPTConfig.block_keeps): each stage's
    blocks within 2% of what autograd keeps in them, below a chunk and at three."""
    from plait.estimate.activations import stage_block_bytes

    shape = sweep_family(tmp_path / family, family)
    assert shape.block_keeps
    for batch, seq in ((1, 16), (1, 192)):
        kept = saved_by_where(tmp_path / family, torch.float32, batch, seq)
        layout = Workload(micro_batch=batch, seq_len=seq, pp=2)
        for stage in layout_stages(shape, layout):
            measured = sum(kept.get(block, 0) for block in stage.blocks)
            assert stage_block_bytes(shape, layout, stage) / measured == pytest.approx(1, abs=0.02), (seq, stage.blocks)


def test_a_bias_sdpa_keeps_is_its_s2_term(tmp_path: Path) -> None:
    """Inkling hands SDPA its relative position bias as a float mask, b·heads·s² values the
    kernel keeps for the bias's gradient, made of s × s gathers that keep their indices. Read as
    SDPA's (two lengths, no s² term), the estimate was 1.12 of autograd's keep at 16 tokens and
    0.77 at 256. A block that keeps an s × s tensor at both lengths is measured at a third:
    within 1% from 16 tokens to 256 (the CPU's SDPA keeps its softmax where a GPU's keeps the
    bias, as many bytes in fp32)."""
    shape = sweep_family(tmp_path / "inkling", "inkling_text")
    assert shape.attention_matrix_bytes[0] > 0
    for seq in (16, 64, 256):
        assert estimate_over_keep(tmp_path / "inkling", shape, 1, seq) == pytest.approx(1, abs=0.01), seq


def test_the_reading_is_the_same_each_time(tmp_path: Path) -> None:
    """DeepSeek-V4 makes temporaries of its rotary tables; held by address alone, a freed one's
    address went to the next storage made, which was then read as a table's: its estimate moved
    between 0.87 and 1.8 of autograd's keep from one reading to the next. Held while listed,
    two readings agree, to the byte at one sequence."""
    first = sweep_family(tmp_path / "a", "deepseek_v4")
    second = sweep_family(tmp_path / "b", "deepseek_v4")
    assert (first.block_saved_bytes, first.constant_bytes, first.position_table_bytes) == \
        (second.block_saved_bytes, second.constant_bytes, second.position_table_bytes)
    assert estimate_over_keep(tmp_path / "a", first, 1, 64) == 1


def test_a_table_the_forward_remakes_leaves_no_address_to_an_activation(tmp_path: Path) -> None:
    """XGLM's forward remakes its sinusoidal table once the positions pass its length; the
    table it drops was listed by address as the model's own, and an activation later made at
    that address was not counted: 12 readings in 40 differed (five values), its sweep rows read
    1.13-1.16. The model's tensors are held while listed: twenty readings agree, to the byte of
    autograd's keep."""
    shape = sweep_family(tmp_path / "xglm", "xglm")
    readings = {(again.block_saved_bytes, again.constant_bytes)
                for again in (sweep_family(tmp_path / f"xglm{i}", "xglm") for i in range(20))}
    assert readings == {(shape.block_saved_bytes, shape.constant_bytes)}
    assert estimate_over_keep(tmp_path / "xglm", shape, 2, 16) == 1


def test_a_blocks_activations_are_what_autograd_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a transformers block keeps per token, measured when the shape is read
    (block_saved_bytes) and priced in the activations, held to what autograd keeps on the CPU
    (the s term at 64, 128 and 192 tokens), in fp32 and bf16: a dense block, an MoE, Mamba's,
    Qwen3-Next's and Jamba's torch paths, where the formulas alone priced a tenth to a half of
    it (Mamba's bf16 0.09, Jamba's fp32 0.46). Measured as a small model is, on zeroed CPU
    memory, within 10%; and as a large one is, on meta (SDPA counted as its flash kernels keep,
    grouped experts' fp32 shifted from bf16), within 16% (Qwen3-Next's fp32 0.84 of what
    autograd keeps without a key/value cache, as training runs it; 0.86 of what it kept with one)."""
    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import Workload, layout_stages
    from plait.models.hf import load

    cases = {"llama": {}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "mamba": {},
             "qwen3_next": dict(num_hidden_layers=4, **LINEAR, **MOE), "jamba": JAMBA}
    kept = {(family, dtype): None for family in cases for dtype in (torch.float32, torch.bfloat16)}
    formulas_alone = {}
    for where, band in (("cpu", 0.10), ("meta", 0.16)):
        monkeypatch.setattr(load, "CPU_MEASURED_PARAMS", load.CPU_MEASURED_PARAMS if where == "cpu" else 0)
        for family, fields in cases.items():
            shape = shape_of(tmp_path / where / family, family, **fields, max_position_embeddings=1024)
            for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                def estimated(seq: int, shape: Any = shape) -> float:
                    layout = Workload(micro_batch=1, seq_len=seq, precision=precision)
                    return stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])

                if kept[family, dtype] is None:
                    kept[family, dtype] = s_term(lambda seq: saved_by_autograd(tmp_path / where / family, dtype, 1, seq))
                ratio = s_term(estimated) / kept[family, dtype]
                assert abs(ratio - 1) < band, (where, family, precision, ratio)
                alone = s_term(lambda seq: estimated(seq, replace(shape, block_saved_bytes=())))
                formulas_alone[family, precision] = alone / kept[family, dtype]
    assert all(formulas_alone[family, precision] < 0.5 for family in ("mamba", "qwen3_next", "jamba")
               for precision in ("fp32", "bf16")), formulas_alone


def test_a_stage_that_runs_the_models_own_forward_holds_its_pieces_where_that_forward_runs_them(
        tmp_path: Path) -> None:
    """OPT registers its final norm before its layers and runs it after them: a pipeline of it
    runs the model's own forward, whose last stage holds the norm (the wire sweep's opt/pp
    counts each rank's parameters so). Dory's config counts a block's attention and its MLP as
    two layers, 6 for its 3 blocks: read as its 3 blocks, each run once."""
    from plait.estimate.layout import Workload, layout_stages

    opt = shape_of(tmp_path / "opt", "opt", ffn_dim=64, word_embed_proj_dim=32)
    model = meta_model(tmp_path / "opt")
    decoder = model.model.decoder
    block = sum(p.numel() for p in decoder.layers[0].parameters())
    norm = sum(p.numel() for p in decoder.final_layer_norm.parameters())
    ends = sum(p.numel() for module in (decoder.embed_tokens, decoder.embed_positions) for p in module.parameters())
    head = model.lm_head.weight.numel()  # tied to the embedding, a copy on the last stage
    first, last = layout_stages(opt, Workload(pp=2, micro_batch=1, grad_accum=2, seq_len=16, precision="fp32"))
    assert (first.layers, last.layers, norm) == (1, 1, 64)
    assert (first.params, last.params) == (ends + block, block + norm + head)  # the norm once counted on the first
    dory = shape_of(tmp_path / "dory", "dory", num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                    n_output_layers=1, n_recurrent_loops=1, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert dory.n_layers == 3 and len(dory.block_tally) == 3
    assert dory.num_params() == meta_params(tmp_path / "dory")


def test_a_looped_models_blocks_cost_once_a_run_and_hold_their_parameters_once(tmp_path: Path) -> None:
    """Dory runs its recurrent blocks n_recurrent_loops times a forward, Inkling-2-Loop its loop
    layers loop_num_passes times (GPTConfig.block_runs, read by one forward on meta): each run
    computes, keeps its activations and dispatches its tokens to the experts again, while the
    block's parameters, gradients and optimizer state are held once. Inkling-2-Loop's experts'
    all-to-all, priced once a block, was 1.35x under the ledger's (the transformers sweep's
    ep case); priced once a run, it is within the sweep's routing band."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.memory import stage_memory
    from plait.estimate.time import flops_per_token
    from plait.estimate.traffic import estimate_comm

    dory = shape_of(tmp_path / "dory", "dory", num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                    n_output_layers=1, n_recurrent_loops=3, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert dory.block_runs == (1, 3, 1) and dory.num_params() == meta_params(tmp_path / "dory")
    once = replace(dory, block_runs=())
    layout = Workload(micro_batch=2, seq_len=16, precision="fp32")
    looped, single = (layout_stages(s, layout)[0] for s in (dory, once))
    assert (looped.layers, looped.runs, looped.params) == (3, 5, single.params)
    looped_memory, single_memory = (stage_memory(s, layout, stage) for s, stage in ((dory, looped), (once, single)))
    assert looped_memory.params == single_memory.params and looped_memory.optim == single_memory.optim
    assert looped_memory.activations > single_memory.activations
    assert flops_per_token(dory, 16)[0] > flops_per_token(once, 16)[0]
    with pytest.raises(PlaitError, match=r"forward runs block 1 more than once \(a loop\)"):
        Workload(pp=2, micro_batch=1, grad_accum=2, seq_len=16, precision="fp32").check_model(dory)

    loop = shape_of(tmp_path / "loop", "inkling2_loop_text", num_hidden_layers=3, n_layers_per_attn_res_block=1,
                    loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8,
                    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, unpadded_vocab_size=128)
    assert loop.block_runs == (1, 2, 1)
    experts = Workload(dp=2, ep=2, micro_batch=2, seq_len=16, precision="fp32")
    dispatched = [estimate_comm(s, experts)["ep"]["all_to_all"] for s in (loop, replace(loop, block_runs=()))]
    assert dispatched[0] == pytest.approx(dispatched[1] * 4 / 3)  # 4 runs of 3 MoE blocks
    assert estimate_comm(loop, experts)["dp"] == estimate_comm(replace(loop, block_runs=()), experts)["dp"]


def test_a_parameter_no_optimizer_trains_is_held_but_not_synced(tmp_path: Path) -> None:
    """AFMoE's router balancing bias is a parameter with requires_grad False (the model moves it
    itself): each MoE block holds it (GPTConfig.frozen_block_params), and the estimate gives it
    no gradient, no optimizer state and no place in the data ranks' all-reduce: the ledger's
    bytes (the transformers sweep's ep case) were 16 a step under the estimate's before."""
    from plait.estimate.layout import Workload, layout_stages
    from plait.estimate.memory import stage_memory
    from plait.estimate.traffic import estimate_comm

    shape = shape_of(tmp_path, "afmoe", num_experts=4, num_shared_experts=1, num_dense_layers=1, sliding_window=6,
                     global_attn_every_n_layers=2, num_experts_per_tok=2, moe_intermediate_size=32)
    assert shape.frozen_block_params == (0, 4)  # its dense first block, then an MoE block's 4 experts' biases
    trained = replace(shape, frozen_block_params=())
    layout = Workload(dp=2, micro_batch=2, seq_len=16, precision="fp32")
    synced = estimate_comm(shape, layout)["dp"]["all_reduce"]
    assert estimate_comm(trained, layout)["dp"]["all_reduce"] - synced == 2 * (2 - 1) / 2 * 4 * 4
    frozen, every = (stage_memory(s, layout, layout_stages(s, layout)[0]) for s in (shape, trained))
    assert (frozen.params, every.grads - frozen.grads, every.optim - frozen.optim) == (every.params, 16, 32)


def test_hrms_two_stacks_are_counted_as_one_list_and_its_frozen_state_whole(tmp_path: Path) -> None:
    """HRM's plans name its two block lists (`L_module.layers`, `H_module.layers`), so no one
    list is named: read as one stack with no name, the formulas stood for its blocks, and its
    frozen initial state (`z_L_init`) was priced as trained; `plait train --zero 3` measured 8 KiB
    of gradient shards more than the estimate a rank on 2. Both stacks are read as one list now,
    each block counted, and the state whole: every trained parameter the model has, no more."""
    shape = shape_of(tmp_path, "hrm_text", num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    stacks = [model.model.L_module.layers, model.model.H_module.layers]
    assert [block[0] for block in shape.block_tally] == [sum(p.numel() for p in stack[0].parameters())
                                                         for stack in stacks]
    assert shape.frozen_extra_params == model.model.z_L_init.numel() == shape.d_model
    (stage,) = layout_stages(shape, Workload())
    assert stage.trained_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert stage.params == sum(p.numel() for p in model.parameters())


def test_a_swiglu_mlp_makes_its_product_again_as_plaits_block(tmp_path: Path) -> None:
    """plait builds a transformers model whose MLP reads down_proj(act_fn(gate_proj(x)) *
    up_proj(x)) with a SiLU so that it keeps gate and up alone (models/hf/gated.py): 2f values
    a token a block fewer than transformers' own forward keeps (silu's output and the product),
    with transformers' gradients bit for bit. The estimate reads which MLPs it took
    (`remade_products`) and prices the keep; GELU's MLP (Gemma's) and Phi's fused gate|up keep
    their own forward."""
    from plait.estimate.activations import remakes_product
    from plait.estimate.layout import Workload
    from plait.models.hf.gated import remade
    from plait.models.hf.load import build_hf_model

    taken = {"llama": True, "mistral": True, "qwen2": True, "olmo2": True, "gemma": False, "phi3": False}
    for family, expected in taken.items():
        shape = shape_of(tmp_path / family, family, pad_token_id=0)
        assert shape.remade_products is expected, family
        assert remakes_product(shape, Workload()) is expected, family
        assert not remakes_product(shape, Workload(recompute="full")), family  # the checkpoint keeps the input alone
    # compiled, Inductor keeps what it chooses: the formulas' 4f, not the eager reading's 2f
    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import layout_stages

    shape = shape_of(tmp_path / "llama", "llama", pad_token_id=0)
    eager, compiled = (stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])
                       for layout in (Workload(seq_len=32), Workload(seq_len=32, compiled=True)))
    assert compiled - eager == 2 * SHAPE["intermediate_size"] * 4 * 32 * SHAPE["num_hidden_layers"]
    llama = read_hf_dir(f"hf:{tmp_path / 'llama'}")
    ours = build_hf_model(llama, seed=0)
    assert all(remade(layer.mlp) for layer in ours.model.layers)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama")
    config.use_cache = False
    theirs = transformers.AutoModelForCausalLM.from_config(config).float().train()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    kept = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
        resident = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        kept[name] = sum(n for key, n in storages.items() if key not in resident)
        loss.backward()
    f, tokens, blocks = SHAPE["intermediate_size"], 2 * 16, SHAPE["num_hidden_layers"]
    assert kept["theirs"] - kept["ours"] == 2 * f * tokens * 4 * blocks
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(mine.grad, other.grad), name


def cpu_estimate(shape: Any, precision: str, batch: int, seq: int, device: str = "cpu") -> float:
    """The estimate's activations of one process on `device`."""
    from plait.estimate.activations import stage_activation_bytes

    layout = Workload(micro_batch=batch, seq_len=seq, precision=precision, device=device)
    return stage_activation_bytes(shape, layout, layout_stages(shape, layout)[0])


def test_a_cpu_keeps_what_its_math_form_of_sdpa_keeps(tmp_path: Path) -> None:
    """Doge hands SDPA a mask made from its values (a dynamic mask that needs its gradient), and
    DeepSeek-V3's latent attention a V narrower than K. A GPU's fused kernel takes both and keeps
    q, k, V, its output, a log-sum-exp (and the mask); a CPU runs SDPA's math form, which keeps
    scaled q and k, V and the s × s softmax (in fp32 under bf16 too). The estimate, reading the
    fused kernel's keep, was 1.03 of Doge's CPU keep in fp32 (144 B a token a block over: the
    output and the log-sum-exp) and 0.84-0.92 in bf16; DeepSeek-V3's 0.64-1.004. A run on a CPU
    (Workload.device) adds what the math form keeps beyond, read from the same forwards, and
    what a batch of it keeps beyond as many sequences (in fp32 the math form views one
    sequence's V in the fused projection's output and copies a batch's: 1.035 at two sequences
    without it): to the byte at one to three sequences of 16 to 64 tokens, both dtypes. On a GPU
    it stays the kernel's."""
    for family in ("doge", "deepseek_v3"):
        shape = sweep_family(tmp_path / family, family)
        assert shape.cpu_sdpa_bytes[0][:6] == (0.0, -144.0, 0.0, 0.0, 16.0 * (family != "doge"), 0.0), family
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for batch, seq in ((1, 16), (2, 16), (3, 16), (2, 64)):
                kept = saved_by_autograd(tmp_path / family, dtype, batch, seq)
                assert cpu_estimate(shape, precision, batch, seq) == kept, (family, precision, batch, seq)
                assert cpu_estimate(shape, precision, batch, seq, device="cuda") != kept
    assert not sweep_family(tmp_path / "llama", "llama").cpu_sdpa_bytes  # every call fused on a CPU too


def test_an_additive_mask_a_block_makes_is_kept_by_the_fused_kernel(tmp_path: Path) -> None:
    """MiniMax-M3's sparse layers make an additive mask from their block index and hand it to
    SDPA, whose fused kernel keeps it for its backward (a CPU's and a GPU's alike). The reading
    counted a mask only where it needed its gradient: 0.97 of autograd's keep at 16 tokens, 0.90
    at 2 × 64 (16 B a pair a sparse layer). Now to the byte, both dtypes."""
    shape = sweep_family(tmp_path / "m3", "minimax_m3_vl_text")
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for batch, seq in ((1, 16), (2, 64)):
            assert cpu_estimate(shape, precision, batch, seq) == saved_by_autograd(tmp_path / "m3", dtype, batch, seq)


def test_the_cpu_runs_sdpa_in_its_math_form_where_torch_says() -> None:
    """`_cpu_takes_math` asks torch's own choice on CPU stand-ins of the call: a mask that needs
    its gradient, a V narrower than K or dropout take the math form; a causal call, a mask
    without a gradient and grouped heads the fused kernel."""
    from plait.models.hf.load import _cpu_takes_math, _sdpa_options

    def takes_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        return _cpu_takes_math(q, k, v, _sdpa_options(args, kwargs))

    q, kv = torch.empty(1, 4, 16, 8, device="meta"), torch.empty(1, 2, 16, 8, device="meta")
    mask = torch.empty(1, 4, 16, 16, device="meta")
    assert not takes_math(q, kv, kv, is_causal=True, enable_gqa=True)
    assert not takes_math(q, q, q, mask)
    assert takes_math(q, q, q, mask.requires_grad_())
    assert takes_math(q, q, q[..., :4])
    assert takes_math(q, q, q, None, 0.1)


def test_parallelize_gives_a_transformers_model_the_remade_product(tmp_path: Path) -> None:
    """`plait.parallelize` on a transformers model object (the API, not `--model hf:DIR`) kept
    transformers' own MLP forward: 2f values a token a block more than the estimate of the same
    model prices. It now gives the model the forward plait's builds give it, in place as the
    layout changes the model, with the same gradients bit for bit; plait's own GPT is left as
    it is."""
    from plait.api import parallelize
    from plait.models.gpt.model import build_gpt
    from plait.models.gpt.config import get_preset
    from plait.models.hf.gated import remade
    from plait.parallel.compose import ParallelConfig
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh

    shape_of(tmp_path / "llama", "llama", pad_token_id=0)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama")
    config.use_cache = False
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).float().train()
    ours = transformers.AutoModelForCausalLM.from_config(config).float().train()
    ours.load_state_dict(theirs.state_dict())
    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    ours = parallelize(ours, mesh, ParallelConfig())
    assert all(remade(layer.mlp) for layer in ours.model.layers)
    assert not any(remade(layer.mlp) for layer in theirs.model.layers)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (ours, theirs):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(mine.grad, other.grad), name
    gpt = build_gpt(get_preset("tiny"), 0)
    assert "forward" not in vars(parallelize(gpt, mesh, ParallelConfig()).blocks[0].mlp)


def test_a_sliding_layers_repeated_heads_are_its_own_width(tmp_path: Path) -> None:
    """Where the sequence reaches the window, transformers repeats a sliding layer's K/V heads
    up to q's for SDPA. Gemma 4's sliding layers have heads half as wide as its global ones
    (8 and 16 in the tiny config), and the estimate priced the repeat by the mean width (12):
    1.008 of autograd's keep at every batch, length and dtype (16 values a token over), 1.022 of
    the meter under pp 2. It now takes the repeat as read, the sliding layers' own: to the byte."""
    shape = sweep_family(tmp_path / "g4", "gemma4_unified_text")
    assert shape.head_widths == (12, 12, 12) and shape.sliding_mask_layers == 0.5
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for batch, seq in ((1, 16), (2, 32)):
            assert cpu_estimate(shape, precision, batch, seq) == saved_by_autograd(tmp_path / "g4", dtype, batch, seq)


def test_plait_estimate_prices_a_cpu_run_where_asked(tmp_path: Path, capsys: Any) -> None:
    """`plait estimate --device cpu` (the default under `--hardware cpu`) prices what a CPU's
    SDPA math form keeps: DeepSeek-V3 at 64 tokens is autograd's keep on the CPU to the byte,
    where the GPU's fused kernel's keep is 0.81 of it."""
    import json

    from plait.estimate.cli import estimate_main
    from plait.families import shape_of as family_shape

    sweep_family(tmp_path / "ds", "deepseek_v3")
    kept = saved_by_autograd(tmp_path / "ds", torch.float32, 1, 64)
    read = {}
    for flags in ((), ("--device", "cpu"), ("--hardware", "cpu")):
        estimate_main(["--model", f"hf:{tmp_path / 'ds'}", "--seq-len", "64", *flags, "--json"], family_shape)
        read[flags] = json.loads(capsys.readouterr().out)["memory"]["activations"]
    assert read[("--device", "cpu")] == read[("--hardware", "cpu")] == kept
    assert read[()] == pytest.approx(0.81 * kept, abs=0.005 * kept)


def test_the_time_model_makes_again_the_products_a_transformers_model_makes_again(tmp_path: Path) -> None:
    """The time model prices the gated product made again in backward over the MLP units that
    make it again (ops.remade_units, remade_calls): a transformers model's dense MLPs and its MoE
    blocks' shared experts where plait gives them the remaking, not its grouped routed experts,
    which keep their product. Read from the first dense block alone, DeepSeek-V3's routed
    experts were priced as remade (80 units a token where 48 are) and Qwen2-MoE, every block
    MoE, had its shared experts' remaking left out (0 where 48 are); Mixtral remakes nothing."""
    from plait.estimate.experts import dense_width, routed_and_shared_widths
    from plait.estimate.ops import mlp_units, remade_calls, remade_units

    layout = Workload(seq_len=16)
    qwen = sweep_family(tmp_path / "qwen2_moe", "qwen2_moe")
    assert (qwen.remade_products, qwen.remade_shared) == (False, True)
    assert remade_units(qwen, layout) == routed_and_shared_widths(qwen)[1] == 48 and remade_calls(qwen) == 1
    deepseek = sweep_family(tmp_path / "deepseek_v3", "deepseek_v3")
    assert (deepseek.remade_products, deepseek.remade_shared) == (True, True)
    units = dense_width(deepseek) + routed_and_shared_widths(deepseek)[1]
    assert remade_units(deepseek, layout) == units == 48 < mlp_units(deepseek, layout) == 80
    mixtral = sweep_family(tmp_path / "mixtral", "mixtral")
    assert remade_units(mixtral, layout) == remade_calls(mixtral) == 0
    assert remade_units(qwen, replace(layout, compiled=True)) == 0  # Inductor keeps what it chooses
