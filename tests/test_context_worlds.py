"""Context parallelism trains the same model as one process: plait's GPT, transformers'
Llama and GPT-2 under cp 4, cp 2 × dp 2 (ring and Ulysses), cp 2 × tp 2 + SP, cp 2 × dp 2
with ZeRO-3 and cp 2 × pp 2, through the real Trainer; one attention layer against SDPA; the ring's and
the all-to-all's bytes against the formula; a checkpoint moved between cp degrees. One
4-rank world (tests/worlds/context_world.py) runs everything; a second one, in make test-all,
adds full recompute, ZeRO-1 and -2, bf16, Qwen3 and Mistral."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plait.estimate.context import context_bytes
from tests.parity import PARAM_ATOL, assert_losses_close
from tests.worldlib import run_world

transformers = pytest.importorskip("transformers")

B, H, SEQ, D = 2, 4, 16, 8  # the attention check's shape (tests/worlds/context_world.py)
LAYOUTS = ("cp4", "cp2-dp2", "ulysses-cp2-dp2", "cp2-tp2-sp", "cp2-dp2-zero3", "cp2-pp2")
BF16_RTOL = 2e-3  # tests/test_precision_worlds.py's bar: 16-bit sums in another order


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local transformers directories (config.json only) and a corpus."""
    root = tmp_path_factory.mktemp("context")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(root / "llama")
    transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
                            ).save_pretrained(root / "gpt2")
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    transformers.Qwen3Config(**shape, head_dim=8).save_pretrained(root / "qwen3")  # per-head q/k norms
    transformers.MistralConfig(**shape, sliding_window=6).save_pretrained(root / "mistral")  # shorter than seq 16
    (root / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    return root


def _world(root: Path, name: str, *extras: str) -> list[dict[str, Any]]:
    _, reports = run_world("context_world.py", 4, root / name, str(root / name), str(root / "corpus.txt"),
                           str(root / "llama"), str(root / "gpt2"), *extras)
    return reports


@pytest.fixture(scope="module")
def world(models: Path) -> list[dict[str, Any]]:
    return _world(models, "world")


@pytest.fixture(scope="module")
def extra(models: Path) -> list[dict[str, Any]]:
    return _world(models, "extra", "--extras", str(models / "qwen3"), str(models / "mistral"))


@pytest.mark.parametrize("run", ["ring-cp4", "ring-cp2", "ring-plain-cp2", "ulysses-cp2"])
def test_one_attention_layer_matches_sdpa_on_the_whole_sequence(world: list[dict[str, Any]], run: str) -> None:
    """Causal, full, and under a sliding window of 5 positions (tests/worlds/context_world.py)."""
    assert any(case.endswith("-window5") for case in world[0]["attention"][run]), run
    for rank in world:
        for case, found in rank["attention"][run].items():
            assert max(found["errors"]) < 1e-12, (run, case, found["errors"])  # fp64: output, dq, dk, dv


@pytest.mark.parametrize("run", ["ring-cp4", "ring-cp2", "ring-plain-cp2", "ulysses-cp2"])
def test_the_ledger_counts_the_formulas_collectives_and_bytes(world: list[dict[str, Any]], run: str) -> None:
    """fp64 tensors; per rank, one layer, forward and forward + backward, by kind."""
    kind, cp = run.replace("-plain", "").split("-cp")
    for case, found in world[0]["attention"][run].items():
        kv_heads = int(case.split("-")[0][2:])
        v_head_dim = int(case.split("-v")[1].split("-")[0]) if "-v" in case else D  # V's heads half as wide ("-v")
        formula = context_bytes(kind, int(cp), batch=B, seq=SEQ, heads=H, kv_heads=kv_heads, head_dim=D,
                                v_head_dim=v_head_dim, bytes_per_value=8, wide_bytes=8)
        if kind == "ring":  # forward cp−1 transfers; backward cp−1 more of K/V and cp of dK/dV
            assert found["calls"] == {"send": 3 * int(cp) - 2, "recv": 3 * int(cp) - 2}, case
            assert found["forward"] == {"send": formula["forward"], "recv": formula["forward"]}, case
            total = formula["forward"] + formula["backward"]
            assert found["total"] == {"send": total, "recv": total}, case
        else:  # q, k, v to heads and the output back; the same four reversed in backward
            assert found["calls"] == {"all_to_all": 8}, case
            assert found["forward"] == {"all_to_all": formula["forward"]}, case
            assert found["total"] == {"all_to_all": formula["forward"] + formula["backward"]}, case


@pytest.mark.parametrize("family", ["gpt", "llama", "gpt2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_trains_the_same_model_as_one_process(world: list[dict[str, Any]], family: str,
                                                          layout: str) -> None:
    found = world[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]
    for rank in world[1:]:
        assert rank[family][layout]["losses"] == found[layout]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("gpt", "cp2-dp2-zero1"), ("gpt", "cp2-dp2-zero2"),
                                            ("gpt", "cp2-dp2-recompute"), ("llama", "cp2-dp2-recompute"),
                                            ("gpt2", "cp2-dp2-recompute")])
def test_zero_1_2_and_recompute_under_cp_train_the_same_model(extra: list[dict[str, Any]], family: str,
                                                             layout: str) -> None:
    found = extra[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("qwen3", "cp2-dp2"), ("mistral", "cp2-dp2"),
                                            ("mistral", "ulysses-cp2-dp2")])
def test_other_transformers_families_train_the_same_model_under_cp(extra: list[dict[str, Any]], family: str,
                                                                   layout: str) -> None:
    """Mistral's sliding window (6 tokens) is shorter than the sequence (16): the ring and
    Ulysses each mask by it, and train the one-process model."""
    found = extra[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]


@pytest.mark.slow
def test_bf16_under_cp_trains_as_one_process_in_bf16(extra: list[dict[str, Any]]) -> None:
    found = extra[0]["bf16"]
    assert_losses_close(found["cp2-dp2"]["losses"], found["one"]["losses"], rtol=BF16_RTOL)


def test_a_checkpoint_moves_between_cp_degrees_and_layouts(world: list[dict[str, Any]]) -> None:
    """Saved after step 1 at cp 2 × dp 2; step 2 at cp 4 and at tp 2 × dp 2 is one process's step 2."""
    expected = world[0]["gpt"]["one"]["losses"][1:]
    for layout in ("cp4", "tp2-dp2"):
        assert_losses_close(world[0]["resumed"][layout], expected)


def test_what_the_split_cannot_honour_is_refused_in_one_line(world: list[dict[str, Any]]) -> None:
    refused = world[0]["refusals"]
    assert refused["ulysses_heads"] == ("--cp-kind ulysses splits attention heads over cp: 3 heads (per tp rank) "
                                        "are not divisible by cp=2 (hint: use --cp-kind ring, or a cp that divides "
                                        "the heads)")
    assert refused["not_engaged"] == (
        "shard_batch gave this rank its chunks of each sequence, and the model runs without context parallelism "
        "engaged: its attention would see those chunks only (hint: run the forward and backward inside "
        "plait.context_engaged(model))")
    assert refused["unsharded"] == ("under context parallelism each rank runs its 4 tokens of every sequence "
                                    "(shard_batch), and the model got 8 (hint: pass the model what "
                                    "plait.shard_batch returns)")
    assert refused["mask"] == ("the caller's attention_mask (padding, packed documents) cannot be honoured across "
                               "cp ranks: context parallelism makes the positions and the causal mask itself (hint: "
                               "give packed documents as plait's Packed batches (--doc-mask), train whole, unpadded "
                               "sequences under cp, or drop --cp)")
