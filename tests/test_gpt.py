"""The reference model: exact sizes, causality, deterministic init, tied weights."""

from __future__ import annotations

import pytest
import torch

from plait.errors import PlaitError
from plait.models.config import PRESETS, get_preset
from plait.models.gpt import build_gpt


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_parameter_count_matches_the_config(name):
    model = build_gpt(get_preset(name), seed=0)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()


def test_preset_sizes():
    assert PRESETS["tiny"].num_params() < 1_000_000
    assert 9e6 < PRESETS["small"].num_params() < 11e6
    assert round(PRESETS["gpt2-124m"].num_params() / 1e6) == 124
    assert round(PRESETS["llama-7b"].num_params() / 1e9, 2) == 6.74
    assert round(PRESETS["llama-70b"].num_params() / 1e9) == 69


def test_unknown_preset_lists_the_names():
    with pytest.raises(PlaitError, match="unknown model preset 'gpt5'") as err:
        get_preset("gpt5")
    assert "tiny" in err.value.hint and "llama-70b" in err.value.hint


def test_same_seed_same_weights_and_untouched_global_rng():
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a, b = build_gpt(get_preset("tiny"), 1), build_gpt(get_preset("tiny"), 1)
    assert torch.rand(1) == before  # building a model does not consume the caller's RNG
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_attention_is_causal():
    model = build_gpt(get_preset("tiny"), 0)
    x = torch.randint(0, 256, (1, 12))
    changed = x.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    assert torch.allclose(model(x)[0, :8], model(changed)[0, :8])
    assert not torch.allclose(model(x)[0, 8:], model(changed)[0, 8:])


def test_tied_and_untied_embeddings():
    tied = build_gpt(get_preset("tiny"), 0)
    assert tied.lm_head.weight is tied.embed.weight
    untied = build_gpt(get_preset("tiny", tie_embeddings=False), 0)
    assert untied.lm_head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) == get_preset("tiny", tie_embeddings=False).num_params()


def test_generate_extends_the_prompt():
    model = build_gpt(get_preset("tiny"), 0)
    out = model.generate(torch.tensor([[1, 2, 3]]), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and out[0, :3].tolist() == [1, 2, 3]
