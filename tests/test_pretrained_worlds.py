"""A pretrained `hf:DIR` on the meta path: each rank reads its slices of the safetensors
files (sharded into three, with their index), and every layout trains the one-process model.

One 4-rank world (tests/worlds/pretrained_world.py) trains a Llama with its own weights under
dp, ZeRO-3, tp + sp, pp with uneven stages and cp 2, and two mixtures of experts under ep 2
and ep 2 × ZeRO-3, each against one process: a GPT-OSS, whose checkpoint names its tensors
as the model does, and a Mixtral, whose checkpoint keeps each expert's matrices apart
(transformers fuses them as it loads; plait reads each rank's experts by blocks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.parity import assert_grad_norms_close, assert_losses_close
from tests.worldlib import run_world

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LAYOUTS = ["dp4", "zero3", "tp2+sp", "pp2 uneven", "cp2"]
MOE_LAYOUTS = ["ep2", "ep2 zero3"]
RTOL = {"dp4": 1e-5, "zero3": 1e-5, "tp2+sp": 1e-4, "pp2 uneven": 1e-4, "cp2": 1e-4, "ep2": 1e-4, "ep2 zero3": 1e-4}


def _save_in_three(model: Any, directory: Path) -> None:
    """save_pretrained with the shard size (in kB, as it counts them) that gives three files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters()) // 1000
    for size in range(total // 3, total, max(1, total // 100)):
        model.save_pretrained(directory, max_shard_size=f"{size}KB")
        if len(list(directory.glob("model-*.safetensors"))) == 3:
            return
        for old in directory.glob("model*.safetensors*"):
            old.unlink()
    raise AssertionError("no shard size gives three files")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(123)  # weights no seed of plait's would draw
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False))
    _save_in_three(llama, root / "llama")
    moe = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                                                   head_dim=8, sliding_window=8))
    _save_in_three(moe, root / "moe_gptoss")
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE, num_local_experts=4,
                                                                         num_experts_per_tok=2))
    _save_in_three(mixtral, root / "moe_mixtral")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    return {"llama": root / "llama", "moe_gptoss": root / "moe_gptoss", "moe_mixtral": root / "moe_mixtral",
            "corpus": corpus, "root": root}


@pytest.fixture(scope="module")
def world(dirs: dict[str, Path]) -> list[dict[str, Any]]:
    _, reports = run_world("pretrained_world.py", 4, dirs["root"] / "world", str(dirs["root"] / "world"),
                           str(dirs["corpus"]), str(dirs["llama"]), str(dirs["moe_gptoss"]), str(dirs["moe_mixtral"]))
    return reports


def _check(world: list[dict[str, Any]], family: str, layout: str) -> None:
    found = world[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"], rtol=RTOL[layout])
    assert_grad_norms_close(found[layout]["grad_norms"], found["one"]["grad_norms"], rtol=10 * RTOL[layout])
    assert found[layout]["max_rel"] < 10 * RTOL[layout], found[layout]["max_rel"]
    assert all(report[family][layout]["source"] == "SafetensorsWeights" for report in world)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pretrained_llama_in_three_files_trains_as_one_process(world, layout):
    _check(world, "llama", layout)


@pytest.mark.parametrize("family", ["moe_gptoss", "moe_mixtral"])
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_a_pretrained_mixture_of_experts_trains_as_one_process_under_ep(world, layout, family):
    _check(world, family, layout)


def test_the_one_process_run_starts_from_the_files_weights(world, dirs):
    """The first loss is the pretrained model's on its first batch, not a seeded model's:
    reading the files is what the one-process run did too (transformers' from_pretrained
    would give the same weights; tests/test_hf_cli.py holds that path's bytes)."""
    from safetensors import safe_open

    index = json.loads((dirs["llama"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    with safe_open(str(dirs["llama"] / index["weight_map"]["lm_head.weight"]), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (256, 32)
    assert world[0]["llama"]["one"]["source"] == "SafetensorsWeights"


def test_each_rank_reads_only_its_slices(world):
    """The last block is in no probe copy (that keeps blocks 0 and 1: one of each kind, at least
    two), so what each rank read of it is what the rank holds: under tp 2 + sp half of each
    split weight, at its own offset; under pp 2 (stages of 1 and 2 blocks) nothing on the first
    stage's ranks; under dp 4 all of it, once. A norm's scale stays whole under tp."""
    q, down, norm = (f"model.layers.2.{n}" for n in ("self_attn.q_proj.weight", "mlp.down_proj.weight",
                                                     "input_layernorm.weight"))
    whole = {name: world[0]["llama"]["one"]["read"][name] for name in (q, down, norm)}
    assert whole == {q: [32 * 32], down: [32 * 64], norm: [32]}
    for report in world:
        assert report["llama"]["dp4"]["read"][q] == whole[q]
        tp = report["llama"]["tp2+sp"]["read"]
        assert (tp[q], tp[down], tp[norm]) == ([32 * 32 // 2], [32 * 64 // 2], [32])
    first_stage = [report["llama"]["pp2 uneven"]["read"] for report in world[:2]]  # pp rank 0: ranks 0-1 (dp 2)
    last_stage = [report["llama"]["pp2 uneven"]["read"] for report in world[2:]]
    assert all(q not in read for read in first_stage) and all(read[q] == whole[q] for read in last_stage)


def test_each_ep_rank_reads_only_its_experts_of_a_converted_checkpoint(world):
    """Mixtral's files keep one matrix per expert; the last block is in no probe copy, so what
    a rank read of its experts is what it holds: under ep 2, two of the four experts' three
    matrices, and the two ep ranks between them all four. One process reads all four."""
    def experts(read: list[str]) -> set[int]:
        prefix = "model.layers.2.block_sparse_moe.experts."
        return {int(key[len(prefix):].split(".")[0]) for key in read if key.startswith(prefix)}

    assert experts(world[0]["moe_mixtral"]["one"]["sliced"]) == {0, 1, 2, 3}
    held = [experts(report["moe_mixtral"]["ep2"]["sliced"]) for report in world]
    assert all(len(mine) == 2 for mine in held) and set().union(*held) == {0, 1, 2, 3}, held
    mine = [k for k in world[0]["moe_mixtral"]["ep2"]["sliced"] if k.startswith("model.layers.2.block_sparse_moe.")]
    assert len(mine) == 2 * 3  # w1, w2 and w3 of each of its two experts


def test_a_resume_reads_only_this_ranks_slices_of_the_checkpoint(world, dirs):
    """Resuming tp 2 + sp from its own checkpoint, each rank reads half of each split weight
    (and of its Adam moments; the embedding and the head are split too) and all of a norm's
    scale: half the checkpoint and a little more, never all of it."""
    q, norm = "model.layers.2.self_attn.q_proj.weight", "model.layers.2.input_layernorm.weight"
    index = json.loads((dirs["root"] / "world" / "llama" / "resume" / "checkpoints" / "step-00000001" /
                        "index.json").read_text())
    whole = sum(math.prod(t["shape"]) for t in index["tensors"].values())
    for report in world:
        read = report["resumed_tp2+sp"]
        assert sum(read[f"model/{q}"]) == 32 * 32 // 2, read.get(f"model/{q}")
        assert sum(read[f"optim/{q}/exp_avg"]) == 32 * 32 // 2
        assert sum(read[f"model/{norm}"]) == 32
        assert 0.5 * whole < sum(map(sum, read.values())) < 0.55 * whole
