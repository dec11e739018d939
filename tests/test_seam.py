"""The model seam without processes: each family's adapter cuts its model into stages that,
run in a row, are the model; tied weights become two copies; what cannot be cut says why;
and `plait.parallel` knows no model family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import plait
from plait.errors import PlaitError
from plait.models.adapters import adapter_for
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.pipeline.split import logical_parameters, split_stages, tied_copies

transformers = pytest.importorskip("transformers")
SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def hf(family: str, **extra: object) -> nn.Module:
    config = getattr(transformers, f"{family}Config")(**SHAPE, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def test_parallel_imports_nothing_from_models() -> None:
    root = Path(plait.__file__).parent / "parallel"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("plait.models") for n in names), f"{path} imports {names}"


@pytest.mark.parametrize("family,extra", [("Llama", {}), ("Llama", {"tie_word_embeddings": True}),
                                          ("Mistral", {"sliding_window": 5}), ("Qwen2", {})])
@pytest.mark.parametrize("pp,v", [(2, 1), (2, 2)])
def test_llama_family_stages_in_a_row_are_the_model(family: str, extra: dict, pp: int, v: int) -> None:
    model = hf(family, **extra)
    adapter = adapter_for(model)
    assert type(adapter).__name__ == "DeclaredPlanAdapter"
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in split_stages(model, pp, virtual_stages=v, adapter=adapter):
        x = stage(x)
    assert torch.equal(x, model(input_ids=ids).logits)


def test_llama_stages_keep_the_models_names_and_copy_a_tied_embedding() -> None:
    model = hf("Llama", tie_word_embeddings=True)
    first, last = split_stages(model, 2, adapter=adapter_for(model))
    assert last.global_name("model.layers.0.mlp.up_proj.weight") == "model.layers.2.mlp.up_proj.weight"
    assert first.held("lm_head") is None and last.held("model.embed_tokens") is None
    assert last.held("model.rotary_emb") is model.model.rotary_emb
    assert last.lm_head.weight is not first.model.embed_tokens.weight
    assert torch.equal(last.lm_head.weight, first.model.embed_tokens.weight)
    assert tied_copies(nn.ModuleList([first])) == [first.model.embed_tokens.weight]
    assert tied_copies(nn.ModuleList([last])) == [last.lm_head.weight]
    names = {name: replica for name, _, replica in logical_parameters(nn.ModuleList([last]))}
    assert names["model.embed_tokens.weight"] is True and "lm_head.weight" not in names
    assert "model.layers.3.self_attn.q_proj.weight" in names


def test_gpt_is_cut_by_its_own_adapter() -> None:
    model = build_gpt(get_preset("tiny"), 0)
    ids = torch.randint(0, 64, (2, 12))
    x = ids
    for stage in split_stages(model, 2):
        x = stage(x)
    assert torch.equal(x, model(ids))


def test_a_sequential_is_cut_between_its_children() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    stages = split_stages(model, 2)
    assert [name for name, _ in stages[1].named_parameters()] == ["blocks.0.weight", "blocks.0.bias",
                                                                  "blocks.1.weight", "blocks.1.bias"]
    assert stages[1].global_name("blocks.1.weight") == "3.weight"
    x = torch.randn(3, 8)
    assert torch.equal(stages[1](stages[0](x)), model(x))


class MyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_what_cannot_be_cut_says_which_piece_is_missing() -> None:
    with pytest.raises(PlaitError, match="pp 2 needs to know the blocks of MyNet") as info:
        split_stages(MyNet(), 2)
    assert "plait.parallel.seam.ModelAdapter" in info.value.hint and "nn.Sequential" in info.value.hint

    class BlocksOnly:
        def blocks(self, model: nn.Module) -> list[nn.Module]:
            return [model.a]

    with pytest.raises(PlaitError, match="its adapter BlocksOnly has no parts()"):
        split_stages(MyNet(), 2, adapter=BlocksOnly())


def test_only_transformers_classes_of_a_known_family_get_an_adapter() -> None:
    assert adapter_for(build_gpt(get_preset("tiny"), 0)) is None
    assert adapter_for(MyNet()) is None

    class LlamaForCausalLM(nn.Module):  # the name alone, outside transformers
        pass

    assert adapter_for(LlamaForCausalLM()) is None


def test_tensor_plan_refuses_heads_that_do_not_split() -> None:
    model = hf("Llama")
    with pytest.raises(PlaitError, match="num_key_value_heads = 2 is not divisible by tp=4"):
        adapter_for(model).tensor_plan(model, 4, False)
