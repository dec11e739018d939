"""Packed documents with masks train the same model as one process under every axis: plait's
GPT and transformers' Llama under dp × tp + SP, cp 2 × dp 2 (ring and Ulysses), cp 4 and
pp 2 × dp 2 and cp 2 × dp 2 with ZeRO-3, the GPT's mixture of experts under ep 2; the ring and Ulysses with documents
against SDPA's block-causal attention on the whole sequence. One 4-rank world
(tests/worlds/packed_world.py) on a completion corpus, whose loss masks give every
micro-batch its own count of loss tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.parity import PARAM_ATOL, assert_losses_close
from tests.worldlib import run_world

transformers = pytest.importorskip("transformers")

LAYOUTS = ("dp2-tp2-sp", "cp2-dp2", "ulysses-cp2-dp2", "cp4", "pp2-dp2", "cp2-dp2-zero3")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from plait.train.data.prepare import prepare

    root = tmp_path_factory.mktemp("packed")
    transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(root / "llama")
    rows = [{"prompt": f"q{i}: " + "ab" * (i % 5), "completion": f" a{i * 7 % 13}" + "." * (i % 3)}
            for i in range(160)]
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare("bytes", str(root / "c.jsonl"), str(root / "corpus"), eos="257")  # vocabulary 258: tp 2 divides it
    _, reports = run_world("packed_world.py", 4, root / "out", str(root / "out"), str(root / "corpus"),
                           str(root / "llama"), timeout=600)
    return reports


@pytest.mark.parametrize("run", ["ring-cp4", "ring-cp2", "ulysses-cp2"])
def test_the_ring_and_ulysses_keep_attention_inside_each_document(world: list[dict[str, Any]], run: str) -> None:
    for report in world:
        for case, errors in report["attention"][run].items():
            assert max(errors) < 1e-12, (run, case, errors)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_trains_the_packed_model_one_process_trains(world: list[dict[str, Any]], family: str,
                                                                 layout: str) -> None:
    one = world[0][family]["one"]["losses"]
    for report in world:
        assert_losses_close(report[family][layout]["losses"], one)
    assert world[0][family][layout]["excess"] <= PARAM_ATOL, (family, layout)


@pytest.mark.parametrize("layout", ("one", *LAYOUTS, "recompute-selective", "recompute-full"))
def test_packed_documents_keep_the_activations_the_estimate_predicts(world: list[dict[str, Any]],
                                                                      layout: str) -> None:
    """Packed documents' attention keeps one b·s² mask a forward on a CPU (SDPA's, made once
    and shared by every layer), rope rows for every token, and under recomputation the
    documents' numbers: plait's GPT, predicted to the byte on every axis."""
    measured, predicted = world[0]["gpt"][layout]["activations"]
    assert measured == predicted, (layout, measured, predicted)


def test_experts_split_over_ep_train_the_packed_model_one_process_trains(world: list[dict[str, Any]]) -> None:
    assert_losses_close(world[0]["moe"]["ep2-dp4"]["losses"], world[0]["moe"]["one"]["losses"])
    assert world[0]["moe"]["ep2-dp4"]["excess"] <= PARAM_ATOL


def test_what_cannot_carry_documents_is_refused_in_one_line(world: list[dict[str, Any]]) -> None:
    assert "packed documents under cp × pp" in world[0]["refusals"]["hf_cp_pp"]
