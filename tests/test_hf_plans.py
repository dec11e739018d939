"""The declared-plan adapter without processes: transformers' styles in plait's words, the
one-line refusals (a style plait cannot honour, no plan at all, a pp plan that leaves a
parametrised module out), the cut, and the shared region entry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.adapters import adapter_for
from plait.models.hf.plans import DeclaredPlanAdapter, declared
from plait.parallel.pipeline.split import split_stages
from plait.parallel.tensor.entry import SharedEntry
from plait.parallel.tensor.plan import parse_style, resolve_plan
from plait.parallel.tensor.styles import shares_entry, whole_sequence

transformers = pytest.importorskip("transformers")
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
LAYER = "model.layers.*"


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def qwen3(**extra: object) -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, **extra))


def test_qwen3_declared_styles_in_plaits_words() -> None:
    model = qwen3()
    plan = adapter_for(model).tensor_plan(model, 2, False)
    # transformers 5.17 declares no plan for the embedding; later releases split its rows
    embedding = {"model.embed_tokens": "vocab"} if "model.embed_tokens" in declared(model, "tp") else {}
    assert plan == {"lm_head": "column_gather+share", **embedding,
                    **{f"{LAYER}.self_attn.{p}_proj": "column+share" for p in "qkv"},
                    f"{LAYER}.self_attn.q_norm": "grad_sum", f"{LAYER}.self_attn.k_norm": "grad_sum",
                    f"{LAYER}.self_attn.o_proj": "row", f"{LAYER}.mlp.gate_proj": "column+share",
                    f"{LAYER}.mlp.up_proj": "column+share", f"{LAYER}.mlp.down_proj": "row"}
    assert resolve_plan(model, plan)["model.layers.3.self_attn.k_norm"] == "grad_sum"
    assert parse_style("column:2+share") == ("column", 2) and shares_entry("column_gather+share")
    with pytest.raises(PlaitError, match="'row\\+share' is not a style"):
        parse_style("row+share")
    assert parse_style("column_gather+share+whole") == ("column_gather", 1)
    assert shares_entry("column_gather+share+whole") and whole_sequence("vocab+whole")
    with pytest.raises(PlaitError, match="'sequence\\+whole' is not a style"):
        parse_style("sequence+whole")


def test_under_sequence_parallelism_the_ends_read_the_whole_sequence_and_the_norms_sum_once() -> None:
    """Embedding and head split as without SP, on the whole sequence ("+whole", and the head's
    logits split for plait's loss); attention and MLP entered as regions (they read their
    input's shape); the layer norms, which see a slice, summed; q_norm, inside a region, only
    by its own declared style."""
    model = qwen3()
    plan = adapter_for(model).tensor_plan(model, 2, True)
    assert plan["lm_head"] == "column_gather+share+whole"
    assert plan.get("model.embed_tokens", "vocab+whole") == "vocab+whole"  # declared from 5.18 on
    assert DeclaredPlanAdapter().split_head(model, plan)["lm_head"] == "vocab+whole"
    assert plan["model.layers.2.self_attn"] == plan["model.layers.2.mlp"] == "region"
    sequence = {name for name, style in plan.items() if style == "sequence"}
    assert sequence == {f"model.layers.{i}.{norm}" for i in range(4)
                        for norm in ("input_layernorm", "post_attention_layernorm")}
    assert plan[f"{LAYER}.self_attn.q_norm"] == "grad_sum"


@pytest.mark.parametrize("style", ["mla_kv_a_proj", "local_colwise", "embedding_colwise"])
def test_a_style_plait_cannot_honour_is_refused_in_one_line(style: str) -> None:
    model = qwen3()
    model._tp_plan = {**model.tp_plan, f"{LAYER}.mlp": style}
    with pytest.raises(PlaitError) as info:
        adapter_for(model).tensor_plan(model, 2, False)
    assert str(info.value.args[0]) == (f"Qwen3ForCausalLM declares tp_plan['{LAYER}.mlp'] = {style!r}: "
                                       "plait cannot split it that way")
    assert "colwise, colwise_gather_output" in info.value.hint and "tp 1" in info.value.hint


def test_a_model_that_declares_no_plan_has_one_inferred_from_its_layer_names() -> None:
    """A Qwen3 with its plans removed is laid out as its siblings: it gets the adapter, its cut
    and its tp plan are inferred. Its MLP splits as declared; its attention, holding per-head
    norms beside q, k, v and o, stays whole (the inference leaves what it cannot read alone)."""
    model = qwen3()
    model._tp_plan, model._pp_plan = {}, {}
    model.config.base_model_tp_plan, model.config.base_model_pp_plan = {}, {}
    adapter = adapter_for(model)
    assert isinstance(adapter, DeclaredPlanAdapter)
    assert adapter.tensor_plan(model, 2, False) == {
        f"{LAYER}.mlp.gate_proj": "column+share", f"{LAYER}.mlp.up_proj": "column+share",
        f"{LAYER}.mlp.down_proj": "row", "model.embed_tokens": "vocab", "lm_head": "column_gather+share"}
    del model.model.layers[0].mlp.down_proj  # no child laid out as the inference reads: one line
    model.model.layers[0].mlp.down = nn.Linear(64, 32)
    with pytest.raises(PlaitError, match="tensor parallelism needs a plan for a Qwen3ForCausalLM: it declares no "
                                         "tp_plan, and none can be read off its layer names"):
        adapter.tensor_plan(model, 2, False)


def test_a_model_laid_out_otherwise_gets_no_adapter() -> None:
    model = qwen3()
    model._tp_plan, model._pp_plan = {}, {}
    model.config.base_model_tp_plan, model.config.base_model_pp_plan = {}, {}
    model.model._modules = {"pre": nn.Linear(2, 2), **model.model._modules}  # not the embedding first
    assert adapter_for(model) is None


def test_a_model_laid_out_as_its_siblings_is_cut_as_inferred(caplog: pytest.LogCaptureFixture) -> None:
    """No pp plan (or only the head's, as OLMoE and PhiMoE declare): the embedding, the one
    list of layers and the final norm under the base model, and the head, are the cut; the
    stages in a row are the model, and the log says the cut was inferred."""
    model = qwen3()
    model._pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    adapter = DeclaredPlanAdapter()
    with caplog.at_level("INFO", logger="plait.models.hf.plans"):
        parts = adapter.parts(model)
    assert (parts.blocks, parts.first, parts.last) == ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
    assert "declares no pp_plan; cutting it as inferred: model.embed_tokens, model.layers, model.norm, lm_head" \
        in caplog.text
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in split_stages(model, 2, adapter=adapter):
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)


def test_a_model_not_laid_out_as_its_siblings_is_refused_for_pp() -> None:
    model = qwen3()
    model._pp_plan = {}
    embedding = model.model.embed_tokens
    del model.model.embed_tokens
    model.model.embed_tokens = embedding  # registered last: the base model no longer starts with it
    with pytest.raises(PlaitError, match="pp needs to know how to cut Qwen3ForCausalLM: it declares no pp_plan, "
                                         "and it is not an embedding, one list of layers and a final norm"):
        split_stages(model, 2, adapter=DeclaredPlanAdapter())


def test_a_pp_plan_that_leaves_a_parametrised_module_out_is_cut_by_the_models_own_forward(caplog) -> None:
    """The usual stage refuses a module with parameters no piece holds; stages that run the
    model's own forward place it where the forward runs it (the final norm: after the blocks)."""
    model = qwen3()
    model._pp_plan = {name: io for name, io in model.pp_plan.items() if name != "model.norm"}
    adapter = adapter_for(model)
    with caplog.at_level("INFO", logger="plait.models.hf.plans"):
        stages = split_stages(model, 2, adapter=adapter)
    assert "stages run its own forward (pp: Qwen3ForCausalLM's pp_plan places no stage for model.norm" in caplog.text
    assert stages[0].parts.last == ("model.norm", "lm_head")
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in stages:
        stage.token_ids = ids  # as the pipeline runner hands every stage
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)


def test_parameters_held_by_the_base_model_itself_are_refused_for_pp() -> None:
    model = qwen3()
    model.model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(PlaitError) as info:
        split_stages(model, 2, adapter=adapter_for(model))
    assert info.value.args[0] == "pp: Qwen3ForCausalLM's pp_plan places no stage for model, which holds parameters"


def test_a_forward_that_reads_every_block_is_refused_for_pp() -> None:
    """RWKV's forward rescales every block's weights when it turns from eval to training: no
    stage holds them all (found by the own forward's check in training mode)."""
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                                 attention_hidden_size=32, intermediate_size=64))
    with pytest.raises(PlaitError, match="RwkvForCausalLM's pp_plan pieces fail when run in a row"):
        split_stages(model, 2, adapter=adapter_for(model))


@pytest.mark.parametrize("v", [1, 2])
def test_qwen3_stages_in_a_row_are_the_model(v: int) -> None:
    model = qwen3(tie_word_embeddings=True)
    adapter = adapter_for(model)
    parts = adapter.parts(model)
    assert (parts.blocks, parts.first, parts.last, parts.shared) == (
        "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), ("model.rotary_emb",))
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in split_stages(model, 2, virtual_stages=v, adapter=adapter):
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)
    assert len(adapter.blocks(model)) == 4


def test_what_the_forward_does_after_the_head_runs_on_the_last_stage() -> None:
    """Gemma2 caps its logits in its forward, which its pp_plan cannot say: the last stage runs
    the head through that forward, so the stages in a row are the model, cap included."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**{**SHAPE, "head_dim": 4}, final_logit_softcapping=0.5)
    model = transformers.Gemma2ForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in split_stages(model, 2, adapter=adapter_for(model)):
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits) and x.abs().max() <= 0.5


def test_a_forward_that_does_more_than_its_pieces_runs_on_its_own_stages() -> None:
    """A base model whose forward does more than its pieces in a row (here a hook doubling its
    output) fails the usual stage's check; stages that run the model's own forward do it too."""
    model = qwen3()
    model.model.register_forward_hook(lambda module, args, out: out.__class__(last_hidden_state=2 * out[0]))
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    stages = split_stages(model, 2, adapter=adapter_for(model))
    with pytest.raises(PlaitError, match="needs the micro-batch's token ids"):
        stages[1](stages[0](ids))
    for stage in stages:
        stage.token_ids = ids  # as the pipeline runner hands every stage
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)


class SkipToHead(transformers.Qwen3ForCausalLM):
    """Adds the token embeddings to the last hidden states: the head reads more than the blocks hand on."""

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        hidden = self.model(input_ids=input_ids).last_hidden_state + self.model.embed_tokens(input_ids)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.lm_head(hidden))


def test_a_forward_that_reads_more_than_the_blocks_hand_on_is_refused_for_pp() -> None:
    torch.manual_seed(0)
    model = SkipToHead(transformers.Qwen3Config(**SHAPE))
    with pytest.raises(PlaitError, match="pp: SkipToHead's pp_plan pieces fail when run in a row"):
        split_stages(model, 2, adapter=adapter_for(model))


def test_older_transformers_plans_are_composed_from_config_and_class() -> None:
    """Before transformers 5 a model has no `tp_plan`: the base model's plan sits in its
    config (unprefixed) and the head's on the class."""

    class Config:
        base_model_tp_plan = {"layers.*.q": "colwise"}
        base_model_pp_plan = None

    class Causal(nn.Module):
        _tp_plan = {"lm_head": "colwise_rep"}
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.config, self.model, self.lm_head = Config(), nn.Module(), nn.Linear(2, 2)

    assert declared(Causal(), "tp") == {"model.layers.*.q": "colwise", "lm_head": "colwise_rep"}
    assert declared(Causal(), "pp") == {}


def test_column_layers_share_one_entry_per_input() -> None:
    """The same tensor, unchanged, in the same grad mode: the first entry is reused; another
    tensor, an in-place change or a row layer leaving the region: entered again."""
    entry, calls = SharedEntry(), []

    def make(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x * 1.0

    x, y = torch.ones(2), torch.zeros(2)
    first = entry.enter(x, make)
    assert entry.enter(x, make) is first and len(calls) == 1
    entry.enter(y, make)
    assert len(calls) == 2
    x.add_(1)
    entry.enter(x, make)
    entry.enter(x, make)
    assert len(calls) == 3
    with torch.no_grad():
        entry.enter(x, make)
    entry.clear()
    entry.enter(x, make)
    assert len(calls) == 5


def llama4(**extra: object) -> nn.Module:
    """A tiny Llama 4 text model: a dense layer, then an MoE one (experts packed (E, h, 2·d))."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama4_text", vocab_size=64, hidden_size=32, intermediate_size=16,
                                  intermediate_size_mlp=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                                  interleave_moe_layer_step=2, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_llama4s_packed_experts_are_split_by_parameter() -> None:
    """Its declared parameter entries become parameter styles, its experts module "experts";
    under SP its MoE, which flattens its tokens, is a region that runs whole."""
    model = llama4()
    plan = adapter_for(model).tensor_plan(model, 2, False)
    experts = "model.layers.*.feed_forward.experts"
    assert plan[experts] == "experts"
    assert plan[f"{experts}.gate_up_proj"] == "param_row:2" and plan[f"{experts}.down_proj"] == "param_column"
    styles = resolve_plan(model, plan)
    assert styles["model.layers.1.feed_forward.experts.gate_up_proj"] == "param_row:2"  # a parameter's name
    sp = adapter_for(model).tensor_plan(model, 2, True)
    assert sp["model.layers.1.feed_forward"] == "region+whole"  # the MoE reshapes its tokens
    assert sp["model.layers.0.feed_forward"] == "region"  # the dense MLP reads them as they come


def test_a_plan_that_splits_no_attention_need_not_divide_its_heads() -> None:
    """transformers 5.25 declares DeepSeek-V4's plan as its shared experts' MLP alone, beside
    one KV head: tp 2 leaves the attention whole on each rank, and had been refused for that
    head. A plan that splits the attention still needs tp to divide its heads."""
    shape = {**SHAPE, "num_key_value_heads": 1}
    torch.manual_seed(0)
    whole = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    with pytest.raises(PlaitError, match="num_key_value_heads = 1 is not divisible by tp=2"):
        adapter_for(whole).tensor_plan(whole, 2, False)
    mlp_only = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    mlp_only._tp_plan = {key: style for key, style in mlp_only.tp_plan.items() if "self_attn" not in key}
    plan = adapter_for(mlp_only).tensor_plan(mlp_only, 2, False)
    assert not any("self_attn" in key for key in plan)
    assert plan[f"{LAYER}.mlp.gate_proj"].startswith("column") and plan[f"{LAYER}.mlp.down_proj"].startswith("row")


def test_experts_with_no_parameter_split_are_refused() -> None:
    """Summing every rank's whole output would add it tp times."""
    model = llama4()
    model._tp_plan = {key: style for key, style in model.tp_plan.items() if not key.endswith("_proj")
                      or "experts" not in key}
    with pytest.raises(PlaitError, match="'moe_tp_experts' with no parameter of model.layers.1.feed_forward.experts "
                                         "split: plait cannot split it that way"):
        adapter_for(model).tensor_plan(model, 2, False)


def test_a_parameter_style_names_the_dimension_tp_must_divide() -> None:
    from plait.parallel.tensor.styles import check_divisible

    model = llama4()
    styles = {"model.layers.1.feed_forward.experts.gate_up_proj": "param_row:2"}  # (4, 32, 2·16)
    check_divisible(model, styles, 4)
    with pytest.raises(PlaitError, match=r"gate_up_proj.shape\[2\] = 32 \(2 packed parts\) is not divisible by "
                                         r"tp=32 × 2"):
        check_divisible(model, styles, 32)
    with pytest.raises(PlaitError, match="'param_row:x' is not a style"):
        parse_style("param_row:x")
    assert parse_style("param_column:2") == ("param_column", 2)


def test_an_unsplit_attention_reads_the_whole_sequence_under_sp() -> None:
    """HunYuan's plan splits only the embedding and the head: under SP its blocks are found
    from the inferred cut, its attention (a forward taking positions) is "gathered", and its
    norms and MLP run on sequence slices, their gradients summed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("hunyuan_v1_dense", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = AutoModelForCausalLM.from_config(config)
    plan = adapter_for(model).tensor_plan(model, 2, True)
    assert {name for name, style in plan.items() if style == "gathered"} == \
        {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert plan["model.layers.0.mlp.gate_proj"] == plan["model.layers.1.input_layernorm"] == "sequence"


def test_mla_and_attention_sinks_are_read_as_declared() -> None:
    """DeepSeek-V2's kv_a_proj ("mla_kv_a_proj") stays whole, its rotary key's 8 features
    entering the region; Granite-SWA's attention sinks ("colwise" on a 1-D parameter) split by
    head, and the "local_params" on their attention ask for nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from plait.parallel.tensor.styles import param_split_dim

    mla = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "deepseek_v2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2))
    plan = adapter_for(mla).tensor_plan(mla, 2, False)
    assert plan["model.layers.*.self_attn.kv_a_proj_with_mqa"] == "enter_tail:8"
    assert parse_style("enter_tail:8") == ("enter_tail", 8)
    sinks = AutoModelForCausalLM.from_config(AutoConfig.for_model("granite_swa", **SHAPE))
    plan = adapter_for(sinks).tensor_plan(sinks, 2, False)
    assert plan["model.layers.*.self_attn.sinks"] == "param_column"
    assert "model.layers.*.self_attn" not in plan  # local_params: nothing to do
    sink = sinks.model.layers[0].self_attn.sinks
    assert sink.ndim == 1 and param_split_dim(sink, "param_column") == 0


def test_a_layer_that_reads_the_token_ids_reads_them_on_every_stage() -> None:
    """DeepSeek-V4's hash router picks experts by token id (its `tid2eid` table): a later
    stage's forward runs on the micro-batch's own ids, so a table learned or loaded after
    the cut routes as one process does."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["hash_moe", "hash_moe"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    adapter = adapter_for(model)
    stages = split_stages(model, 2, adapter=adapter)
    assert adapter._own is not None  # cut by its own forward (its head reads widened streams)
    tables = [buffer for name, buffer in model.named_buffers() if name.endswith("tid2eid")]
    assert len(tables) == 2
    for table in tables:
        table.copy_(torch.randint(0, 4, table.shape, generator=torch.Generator().manual_seed(5)))
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    with torch.no_grad():
        for stage in stages:
            stage.eval()
            stage.token_ids = ids
            x = stage(x)
        model.eval()
        assert torch.equal(x, model(input_ids=ids).logits)


def gpt_neo(**extra: object) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                       attention_types=[[["global"], 2]], max_position_embeddings=64, **extra)
    return transformers.GPTNeoForCausalLM(config)


def test_an_end_stage_with_no_layer_runs_its_forward_in_the_stages_mode() -> None:
    """GPT-Neo's stages run its own forward (its learned positions): a first stage that holds
    no layer still drops out its embeddings in training, as the one process does."""
    model = gpt_neo(embed_dropout=0.5)
    stages = split_stages(model, 2, balance=[0, 2], adapter=adapter_for(model))
    ids = torch.randint(0, 64, (2, 12))
    stages[0].train()
    stages[0].token_ids = ids
    assert not torch.equal(stages[0](ids), stages[0](ids))  # dropout draws: training mode
    stages[0].eval()
    assert torch.equal(stages[0](ids), stages[0](ids))


def test_layer_drop_is_refused_for_pp() -> None:
    model = transformers.BioGptForCausalLM(transformers.BioGptConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        layerdrop=0.1))
    with pytest.raises(PlaitError) as info:
        split_stages(model, 2, adapter=adapter_for(model))
    assert info.value.args[0] == ("pp: BioGptForCausalLM skips whole layers at random in training (layerdrop = "
                                  "0.1), which a cut into stages cannot draw as one process does")


def test_stages_run_the_models_own_forward_when_asked() -> None:
    """`DeclaredPlanAdapter(own_forward=True)`: a model the usual stage cuts (Qwen3) cut by
    its own forward instead, exactly (benchmarks/own_forward.py times the two)."""
    model = qwen3()
    adapter = DeclaredPlanAdapter(own_forward=True)
    stages = split_stages(model, 2, adapter=adapter)
    assert adapter._own is not None
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in stages:
        stage.token_ids = ids
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)


def test_probe_ids_index_every_table_the_ids_read() -> None:
    """A probe's ids stay below the smallest table indexed by token ids: Gemma 4's per-layer
    embedding may hold fewer rows than its vocabulary (a tiny model's 128 of 256), and a probe
    spread over the whole vocabulary stopped `plait train --tp 2` with torch's IndexError."""
    from plait.models.hf.styles import probe_ids

    config = transformers.AutoConfig.for_model("gemma4_text", **{**SHAPE, "vocab_size": 256},
                                               vocab_size_per_layer_input=128, hidden_size_per_layer_input=8)
    torch.manual_seed(0)
    ids = probe_ids(transformers.AutoModelForCausalLM.from_config(config), 64)
    assert 64 <= int(ids.max()) < 128  # both halves of the smaller table read, none past it
    assert int(probe_ids(qwen3(), 64).max()) >= 32  # a model of one table: spread over its vocabulary
