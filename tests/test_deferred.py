"""The meta build: every family built on the meta device draws, a tensor at a time, exactly
the one-process weights; a split model is filled with its part; the probe's reduced copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import GPT, build_gpt
from plait.models.resnet.config import get_resnet
from plait.models.resnet.model import ResNet
from plait.parallel.deferred import CannotDefer, build_deferred, is_meta
from plait.parallel.materialize import materialize
from plait.parallel.placement import Placement, Split, place, placement_of
from plait.parallel.probe_copy import reduced_copy
from plait.parallel.seam import adapter_of


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _everything(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _assert_draws_are_the_build(build, seed: int = 3) -> None:
    """Each tensor drawn from the meta build is the whole build's, to the bit, and the
    generator ends where the whole build leaves it."""
    torch.manual_seed(seed)
    whole = build()
    after_whole = torch.rand(4)
    torch.manual_seed(seed)
    meta, deferred = build_deferred(build)
    after_meta = torch.rand(4)
    assert is_meta(meta) and not any(t.device.type != "meta" for t in _everything(meta).values())
    expected = _everything(whole)
    assert sorted(deferred.names()) == sorted(expected)
    for name, tensor in _everything(meta).items():
        drawn = deferred.draw_named(name)
        assert drawn.dtype == expected[name].dtype and torch.equal(drawn, expected[name]), name
        assert torch.equal(deferred.draw(tensor), drawn)
    assert torch.equal(after_meta, after_whole)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny,tie_embeddings=false"])
def test_a_gpt_built_on_meta_draws_the_one_process_weights(preset):
    config = get_preset(preset)
    _assert_draws_are_the_build(lambda: GPT(config))


def test_a_resnet_built_on_meta_draws_its_weights_and_batchnorm_buffers():
    config = get_resnet("resnet18", in_channels=1, num_classes=10)
    _assert_draws_are_the_build(lambda: ResNet(config))


def _hf_configs():
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    return {
        "llama (tied)": transformers.LlamaConfig(**shape, tie_word_embeddings=True),
        "qwen2-moe (shared experts, biases)": transformers.Qwen2MoeConfig(
            **shape, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16),
        "gpt2 (Conv1D, learned positions)": transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2,
                                                                    n_positions=32),
        "gemma3 (a scaled embedding's scalar buffer)": transformers.Gemma3TextConfig(**shape, head_dim=4),
    }


@pytest.mark.parametrize("family", ["llama (tied)", "qwen2-moe (shared experts, biases)",
                                    "gpt2 (Conv1D, learned positions)", "gemma3 (a scaled embedding's scalar buffer)"])
def test_a_transformers_model_built_on_meta_draws_from_configs_weights(family, tmp_path):
    from plait.models.hf.config import read_hf_dir
    from plait.models.hf.load import build_hf_model

    _hf_configs()[family].save_pretrained(tmp_path)
    hf = read_hf_dir(f"hf:{tmp_path}")
    _assert_draws_are_the_build(lambda: build_hf_model(hf, seed=5))


class _ReadsItsDraw(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.scale = float(self.weight.sum().item())  # a value read on the host: meta has none


def test_a_build_that_reads_values_on_the_host_is_refused_in_one_line():
    with pytest.raises(CannotDefer, match="cannot be built on the meta device") as refused:
        build_deferred(_ReadsItsDraw)
    assert "whole" in refused.value.hint


def test_materialize_keeps_each_ranks_part_ties_and_attributes():
    """A meta GPT with a tied head, its q projection cut in two along dim 0 as tp's rank 1
    holds it: the part is rows 8..16 of the whole, the tie holds, the placement stays."""
    config = get_preset("tiny")
    whole = build_gpt(config, seed=11)
    meta, deferred = build_deferred(lambda: build_gpt(config, seed=11))
    q = meta.blocks[0].attn.q_proj
    full = tuple(q.weight.shape)
    cut = Placement(full, (Split("tp", 0, 1, 2),))
    q.weight = place(nn.Parameter(torch.empty(cut.local_shape, device="meta")), cut)
    allocated = materialize(meta, torch.device("cpu"), deferred.draw_named)
    assert not is_meta(meta)
    assert torch.equal(q.weight, whole.blocks[0].attn.q_proj.weight[full[0] // 2:])
    assert placement_of(q.weight) == cut
    assert meta.lm_head.weight is meta.embed.weight and torch.equal(meta.embed.weight, whole.embed.weight)
    assert torch.equal(meta.rope_cos, whole.rope_cos)
    held = {id(t): t for t in _everything(meta).values()}
    assert allocated == sum(t.numel() * t.element_size() for t in held.values())


def test_materialize_refuses_a_source_of_another_shape():
    meta, _ = build_deferred(lambda: build_gpt(get_preset("tiny"), seed=0))
    with pytest.raises(PlaitError, match="embed.weight: the source gives"):
        materialize(meta, torch.device("cpu"), lambda name: torch.zeros(3))


def test_the_probes_copy_keeps_one_block_of_each_kind_under_the_models_names():
    """tiny-moe with 4 blocks, every second one a mixture of experts: the copy keeps blocks 0
    and 1 (one of each kind), names its block 1 as the model's block 1, and a finding on it
    applies to every MoE block (1 and 3)."""
    config = get_preset("tiny-moe,n_layers=4,moe_every=2")
    meta, deferred = build_deferred(lambda: build_gpt(config, seed=2))
    twin = reduced_copy(meta, adapter_of(meta))
    assert (twin.blocks, twin.kept) == ("blocks", [0, 1]) and len(twin.model.blocks) == 2
    assert twin.original("blocks.1.mlp.gate.weight") == "blocks.1.mlp.gate.weight"
    assert twin.alike("blocks.1.mlp.gate.weight") == ["blocks.1.mlp.gate.weight", "blocks.3.mlp.gate.weight"]
    assert twin.alike("blocks.0.attn_norm.weight") == ["blocks.0.attn_norm.weight", "blocks.2.attn_norm.weight"]
    assert twin.alike("norm.weight") == ["norm.weight"]
    materialize(twin.model, torch.device("cpu"), lambda name: deferred.draw_named(twin.original(name)))
    whole = build_gpt(config, seed=2)
    assert torch.equal(twin.model.blocks[1].mlp.experts.down_proj, whole.blocks[1].mlp.experts.down_proj)
    assert is_meta(meta)  # the model itself is untouched


def test_a_draw_is_the_callers_own_copy():
    """A later draw of the same tensor (the probe's copy and the model each draw theirs) is
    not changed by what the first caller did to its draw."""
    meta, deferred = build_deferred(lambda: build_gpt(get_preset("tiny"), seed=4))
    first = deferred.draw_named("embed.weight")
    expected = first.clone()
    first.add_(1.0)
    assert torch.equal(deferred.draw_named("embed.weight"), expected)
    assert torch.equal(deferred.draw_named("rope_cos"), deferred.draw_named("rope_cos"))


def test_placeholders_fill_frozen_parameters_and_buffers_and_leave_handles():
    """ZeRO-3's way: a trainable parameter becomes a one-element handle with its shape, and
    the fill gives its values; frozen parameters (MoE's balancing bias) and buffers are filled."""
    from plait.parallel.materialize import placeholders

    config = get_preset("tiny-moe")
    whole = build_gpt(config, seed=9)
    meta, deferred = build_deferred(lambda: build_gpt(config, seed=9))
    fill = placeholders(meta, torch.device("cpu"), deferred.draw_named)
    assert not is_meta(meta)
    q = meta.blocks[0].attn.q_proj.weight
    assert q.shape == whole.blocks[0].attn.q_proj.weight.shape and q.untyped_storage().nbytes() == 4
    assert torch.equal(fill(q), whole.blocks[0].attn.q_proj.weight)
    bias = meta.blocks[0].mlp.expert_bias
    assert not bias.requires_grad and torch.equal(bias, whole.blocks[0].mlp.expert_bias)
    assert torch.equal(meta.rope_sin, whole.rope_sin)
    with pytest.raises(PlaitError, match="not one of the model's placeholders"):
        fill(nn.Parameter(torch.zeros(2)))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_a_shard_filled_a_parameter_at_a_time_is_the_packed_buffers(n):
    """filled_shard gives each rank what pack then cutting gives, padding included."""
    from plait.parallel.zero.shard import filled_shard, pack

    torch.manual_seed(n)
    params = [nn.Parameter(torch.randn(shape)) for shape in [(3, 5), (7,), (2, 2, 2), (1,)]]
    flat = pack(params, n)
    size = flat.numel() // n
    asked = []

    def whole(param: nn.Parameter) -> torch.Tensor:
        asked.append(param)
        return param.detach()

    for rank in range(n):
        asked.clear()
        assert torch.equal(filled_shard(params, n, rank, whole), flat[rank * size:(rank + 1) * size])
        assert len(asked) <= len(params)  # only the parameters that reach into the shard


def test_the_trainer_builds_whole_what_cannot_be_replayed_and_says_so(caplog):
    """build_on_meta: a task whose build reads a drawn value on the host gets its model built
    whole (no source), with one log line; a task that opts out (meta_build = False) too."""
    import logging

    from plait.train.loop.trainer import build_on_meta

    class Task:
        meta_build = True

        def build_model(self, seed: int) -> nn.Module:
            torch.manual_seed(seed)
            return _ReadsItsDraw()

    with caplog.at_level(logging.INFO, logger="plait.train.loop.trainer"):
        model, source = build_on_meta(Task(), seed=1)
    assert source is None and not is_meta(model)
    torch.manual_seed(1)
    assert torch.equal(model.weight, torch.randn(3))  # the whole build's draw, from the seed
    assert any("built whole on every rank" in r.getMessage() for r in caplog.records)
    Task.meta_build = False
    model, source = build_on_meta(Task(), seed=1)
    assert source is None and not is_meta(model)


def test_a_meta_model_without_a_source_is_refused_by_parallelize():
    import plait
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh

    meta, _ = build_deferred(lambda: build_gpt(get_preset("tiny"), seed=0))
    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    with pytest.raises(PlaitError, match="on the meta device, and parallelize was given no source"):
        plait.parallelize(meta, mesh)
