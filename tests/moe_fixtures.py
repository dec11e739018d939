"""The MoE world's inputs and its two runs (tests/worlds/moe_world.py), session fixtures shared
by tests/test_moe_worlds.py and tests/test_moe_zero_worlds.py (registered in conftest.py, so
each world runs once however many files read it)."""

import pytest

@pytest.fixture(scope="session")
def moe_root(tmp_path_factory: pytest.TempPathFactory):
    """A corpus and two local transformers MoE directories (config.json only), for the MoE world."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("moe")
    (root / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    transformers.MixtralConfig(**shape, num_local_experts=4).save_pretrained(root / "mixtral")
    transformers.Qwen2MoeConfig(**shape, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                output_router_logits=True, router_aux_loss_coef=0.05).save_pretrained(root / "qwen2_moe")
    return root


@pytest.fixture(scope="session")
def moe_world(moe_root):
    """tests/worlds/moe_world.py on 4 ranks, once for tests/test_moe_worlds.py and test_moe_zero_worlds.py."""
    from tests.worldlib import run_world

    _, reports = run_world("moe_world.py", 4, moe_root / "out", str(moe_root / "out"), str(moe_root / "corpus.txt"),
                           str(moe_root / "mixtral"), str(moe_root / "qwen2_moe"))
    return reports


@pytest.fixture(scope="session")
def moe_extra(moe_root):
    """tests/worlds/moe_world.py --extras on 4 ranks (make test-all's MoE checks)."""
    from tests.worldlib import run_world

    _, reports = run_world("moe_world.py", 4, moe_root / "extra", str(moe_root / "extra"), str(moe_root / "corpus.txt"),
                           str(moe_root / "mixtral"), str(moe_root / "qwen2_moe"), "--extras")
    return reports
