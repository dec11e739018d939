"""Checkpoints transformers converts as it loads (per-expert matrices it fuses into one tensor),
read a block at a time (plait/models/hf/converted.py): every tensor and every block equal to
what from_pretrained makes of the same files, and a conversion it cannot read refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.models.hf.config import read_hf_dir  # noqa: E402
from plait.models.hf.load import build_hf_model  # noqa: E402
from plait.models.hf.weights import SafetensorsWeights  # noqa: E402
from plait.parallel.deferred import CannotDefer, build_deferred  # noqa: E402

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **SHAPE, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_group=1,
        topk_group=1)),
}


def _saved(family: str, directory: Path) -> dict[str, torch.Tensor]:
    """The family saved as transformers saves it (per-expert keys, several files); what
    from_pretrained makes of the files."""
    torch.manual_seed(0)
    FAMILIES[family]().save_pretrained(directory, max_shard_size="20KB")
    return transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _weights(directory: Path) -> tuple[torch.nn.Module, SafetensorsWeights]:
    hf = read_hf_dir(f"hf:{directory}")
    model, deferred = build_deferred(lambda: build_hf_model(hf, 1))
    return model, SafetensorsWeights(hf, model, deferred.draw_named)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_experts_are_read_by_blocks_as_from_pretrained_makes_them(tmp_path, family):
    """Each tensor whole, and each fused one by an ep rank's experts times a tp rank's rows."""
    want = _saved(family, tmp_path)
    model, weights = _weights(tmp_path)
    assert weights.fused, "the files keep experts one by one"
    names = dict(model.named_parameters())
    for name, tensor in want.items():
        if name in names:
            assert torch.equal(weights(name), tensor), name
    for name in weights.fused:
        tensor = want[name]
        experts, rows = tensor.shape[0] // 2, tensor.shape[1] // 2
        for e, r in ((0, 0), (experts, rows), (1, 3)):
            got = weights.block(name, (e, r, 0), (experts, rows, tensor.shape[2]))
            assert torch.equal(got, tensor[e:e + experts, r:r + rows]), (name, e, r)


def test_a_conversion_it_cannot_read_by_blocks_leaves_the_model_to_from_pretrained(tmp_path, monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    _saved("mixtral", tmp_path)
    odd = [WeightConverter(source_patterns=[".experts.*.w2.weight"], target_patterns=".experts.down_proj",
                           operations=[Transpose(0, 1)])]
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda model: odd)
    with pytest.raises(CannotDefer, match="cannot read by blocks"):
        _weights(tmp_path)
