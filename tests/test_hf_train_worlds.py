"""`plait train --model hf:DIR` trains transformers families plait has no code for (Qwen3's
per-head q/k norms, Mistral's sliding window) under tp 2, pp 2 and dp 2 × ZeRO-3, as one
process does: the tensor and pipeline split come from the plans their configs declare. One
2-rank world runs the real Trainer for every layout (tests/worlds/hf_train_world.py); one
`plait train` run proves the command itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.parity import assert_grad_norms_close, assert_losses_close
from tests.worldlib import run_plait, run_world

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
RTOL = {"tp2": 1e-4, "pp2": 1e-4, "zero3": 1e-5}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local model directories (config.json only: the weights start from the seed; bytes as tokens)."""
    root = tmp_path_factory.mktemp("hf_families")
    made = {"qwen3": transformers.Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=True),
            "mistral": transformers.MistralConfig(**SHAPE, sliding_window=6)}
    for name, config in made.items():
        config.save_pretrained(root / name)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    return {**{name: root / name for name in made}, "corpus": corpus, "root": root}


@pytest.fixture(scope="module")
def world(dirs: dict[str, Path]) -> list[dict[str, Any]]:
    _, reports = run_world("hf_train_world.py", 2, dirs["root"] / "world", str(dirs["root"] / "world"),
                           str(dirs["corpus"]), str(dirs["qwen3"]), str(dirs["mistral"]))
    return reports


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "zero3"])
def test_a_declared_family_trains_as_one_process(world: list[dict[str, Any]], family: str, layout: str) -> None:
    found = world[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"], rtol=RTOL[layout])
    assert_grad_norms_close(found[layout]["grad_norms"], found["one"]["grad_norms"], rtol=10 * RTOL[layout])
    assert found[layout]["max_rel"] < 10 * RTOL[layout], found[layout]["max_rel"]
    assert world[1][family][layout]["losses"] == found[layout]["losses"]


@pytest.mark.slow  # `make test` runs the same Trainer in the world above; this adds the argv and the spawn
def test_the_command_trains_qwen3_with_its_declared_plans(world: list[dict[str, Any]], dirs: dict[str, Path]) -> None:
    out = dirs["root"] / "cli"
    proc = run_plait("train", "--model", f"hf:{dirs['qwen3']}", "--data", str(dirs["corpus"]), "--nproc", "2",
                     "--tp", "2", "--grad-accum", "2", "--steps", "2", "--micro-batch", "2", "--seq-len", "16",
                     "--eval-every", "0", "--eval-samples", "4", "--sample-tokens", "8", "--warmup-steps", "1",
                     "--lr", "1e-3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_losses_close([r["loss"] for r in lines], world[0]["qwen3"]["one"]["losses"], rtol=1e-4)
    assert "dp=1 tp=2 pp=1" in proc.stdout and "  sample      " in proc.stdout
