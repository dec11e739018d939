"""The reference model: exact sizes, causality, deterministic init, tied weights."""

from __future__ import annotations

import pytest
import torch

from plait.errors import PlaitError
from plait.models.gpt.config import PRESETS, get_preset
from plait.models.gpt.model import build_gpt


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


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


def test_a_preset_with_field_overrides():
    config = get_preset("tiny,n_kv_heads=4,n_layers=3,tie_embeddings=false,norm_eps=1e-6")
    assert (config.n_kv_heads, config.n_layers, config.tie_embeddings, config.norm_eps) == (4, 3, False, 1e-6)
    assert config.d_model == PRESETS["tiny"].d_model
    assert get_preset("tiny,n_layers=3", n_layers=5).n_layers == 5  # keyword overrides win


@pytest.mark.parametrize("spec, message", [
    ("tiny,heads=4", "'heads=4' is not FIELD=VALUE for a GPTConfig field"),
    ("tiny,n_layers", "'n_layers' is not FIELD=VALUE"),
    ("tiny,n_layers=two", "n_layers='two' is not a valid int"),
    ("tiny,tie_embeddings=maybe", "tie_embeddings='maybe' is not a valid bool"),
    ("tiny,n_kv_heads=3", "n_heads = 4 is not divisible by n_kv_heads = 3"),
    ("tiny,d_model=66", "d_model = 66 is not divisible by n_heads = 4"),
    ("tiny,n_layers=0", "n_layers must be at least 1"),
])
def test_bad_overrides_name_the_field(spec, message):
    with pytest.raises(PlaitError, match=message):
        get_preset(spec)


def test_a_config_read_back_from_json_is_equal_and_hashable():
    """Runs hand their shape on as JSON (ranks' reports, the closing report), where tuples come
    back as lists: every tuple field is a tuple again, so the config hashes (the estimate caches by it)."""
    import dataclasses
    import json

    from plait.models.gpt.config import GPTConfig

    config = dataclasses.replace(get_preset("tiny"), moe_blocks=(0,), tp_gathered=(1.0, 2.0),
                                 tp_expert_entries=(2.0, 1.0), tp_last_rows=(8, 64),
                                 block_tally=((1, 2, 3, 4),), block_saved_bytes=((1.0, 2.0, 3.0),))
    again = GPTConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config and hash(again) == hash(config)
    tuples = [f.name for f in dataclasses.fields(GPTConfig) if str(f.type).startswith("tuple")]
    assert all(isinstance(getattr(again, name), tuple) for name in tuples), tuples


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
