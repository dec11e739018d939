"""Context parallelism without a world: the head-tail split, the estimator's formulas, and
every refusal `plait train --cp` prints before spawning (one line and a hint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.estimate import estimate_layout
from plait.estimate.context import context_bytes, ring_exposed_s
from plait.models.gpt.config import get_preset
from plait.parallel.context.chunks import local_positions, natural_order, rank_order, shard_sequence


def test_rank_i_holds_chunks_i_and_its_mirror_and_every_rank_has_equal_causal_work() -> None:
    assert local_positions(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    pairs = [sum(p + 1 for p in local_positions(32, rank, 4).tolist()) for rank in range(4)]
    assert len(set(pairs)) == 1  # keys each rank's queries attend to under the causal mask
    ordered = rank_order(16, 4)
    assert torch.equal(ordered[natural_order(16, 4)], torch.arange(16))
    x = torch.arange(32).view(2, 16)
    assert torch.equal(torch.cat([shard_sequence(x, r, 4) for r in range(4)], dim=1)[:, natural_order(16, 4)], x)


def test_ring_bytes_per_layer_are_the_kv_block_times_the_passes() -> None:
    # b 2, s 16, cp 4: a rank's K/V block is 2·2·4·h_kv 2·d 8·4 bytes = 1 KiB.
    ring = context_bytes("ring", 4, batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, bytes_per_value=4)
    assert ring == {"forward": 3 * 1024, "backward": 3 * 1024 + 4 * 1024}
    # Ulysses: q, k, v, out of b·(s/cp)·d·e = 256 bytes per head, (cp−1)/cp of them on the wire;
    # 2 K/V heads do not divide by cp 4, so they travel repeated to the 4 heads.
    ulysses = context_bytes("ulysses", 4, batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, bytes_per_value=4)
    assert ulysses == {"forward": 3 / 4 * 256 * 16, "backward": 3 / 4 * 256 * 16}
    # a latent attention's V heads half as wide as K's: the ring's block 2·4·2·(8 + 4)·4 bytes;
    # Ulysses' q and k 32 values a token, v and the output 16
    narrow = dict(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, v_head_dim=4, bytes_per_value=4)
    assert context_bytes("ring", 4, **narrow) == {"forward": 3 * 768, "backward": 3 * 768 + 4 * 768}
    assert context_bytes("ulysses", 4, **narrow) == {"forward": 3 / 4 * 32 * 96, "backward": 3 / 4 * 32 * 96}
    assert context_bytes("ring", 1, batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, bytes_per_value=4) == {
        "forward": 0.0, "backward": 0.0}
    assert ring_exposed_s(1.0, 2.0, 2) == 0.0 and ring_exposed_s(1.0, 1.0, 2) == 0.5


def test_the_estimate_halves_activations_and_syncs_over_dp_times_cp() -> None:
    small = get_preset("small")
    one = estimate_layout(small, hardware="cpu", micro_batch=2, seq_len=512, dp=2)
    cp = estimate_layout(small, hardware="cpu", micro_batch=2, seq_len=512, cp=2)
    ulysses = estimate_layout(small, hardware="cpu", micro_batch=2, seq_len=512, cp=2, cp_kind="ulysses")
    layers, h, tokens = small.n_layers, small.d_model, 2 * 512 // 2
    rows = 512 // 2 * small.head_dim * 4  # cp's rope rows, gathered for its positions: cos and sin
    # The ring keeps K/V unexpanded and its output in fp32, which o_proj reads as a view: in
    # fp32 the bytes SDPA keeps a token, on half the tokens.
    ratio = (cp["memory"]["activations"] - rows) / one["memory"]["activations"]
    assert ratio == pytest.approx(0.5, rel=1e-3), ratio
    # Ulysses runs the same SDPA on half the tokens, and o_proj keeps the output traded back to
    # sequence shards (h values a token), each block the two int64 reorderings of the sequence.
    traded = layers * (tokens * 4 * h + 2 * 8 * 512)
    assert ulysses["memory"]["activations"] - traded == cp["memory"]["activations"]
    # In bf16 the ring's fp32 output is 2h bytes more a token and layer, and o_proj keeps its
    # cast as Ulysses' o_proj keeps its copy.
    ring16, ulysses16 = (estimate_layout(small, hardware="cpu", micro_batch=2, seq_len=512, cp=2, cp_kind=kind,
                                         precision="bf16")["memory"]["activations"] for kind in ("ring", "ulysses"))
    assert ring16 - ulysses16 == layers * (tokens * 2 * h - 2 * 8 * 512)
    assert set(cp["comm"]) == {"dp_cp", "cp"} and cp["comm"]["dp_cp"] == one["comm"]["dp"]
    block = 2 * 2 * 256 * small.n_kv_heads * small.head_dim * 4  # 2·b·(s/cp)·h_kv·d·e
    per_layer = block + (block + 2 * block)  # forward; backward (K/V again, then dK/dV to 2 ranks)
    assert cp["comm"]["cp"] == {"send": small.n_layers * per_layer, "recv": small.n_layers * per_layer}
    assert cp["time"]["cp_s"] >= 0.0


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("plait: error: ") and lines[1].startswith("  hint: "), lines
    return lines[0]


@pytest.mark.parametrize("flags, words", [
    (["--cp", "2", "--seq-len", "30"], "--seq-len 30 is not divisible by 2·cp = 4"),
    (["--cp", "8", "--cp-kind", "ulysses", "--seq-len", "64"],
     "--cp-kind ulysses splits attention heads over cp: 4 heads per tp rank are not divisible by cp=8"),
    (["--cp", "2", "--tp", "4", "--sp", "--seq-len", "36"], "--sp splits each cp rank's 18 tokens over tp=4"),
    (["--cp", "2", "--cp-kind", "striped"], "unknown --cp-kind 'striped'"),
])
def test_a_split_the_model_cannot_take_is_refused_in_one_line(flags: list[str], words: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(["train", "--model", "tiny", *flags, "--out", str(tmp_path)], capsys)
    assert words in line, line


def test_a_resnet_is_refused_context_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(["train", "--model", "resnet18", "--data", "digits", "--cp", "2", "--out", str(tmp_path)], capsys)
    assert "is trained data-parallel only (DDP or --zero), not with --tp, --pp or --cp" in line


@pytest.mark.parametrize("field, value, words", [
    ("attention_dropout", 0.1, "attention_dropout = 0.1; random draws in the training forward (dropout, router "
                               "noise) are drawn alike on every rank, so 2 processes would not train the one-process model"),
])
def test_what_the_ring_cannot_honour_in_a_transformers_config_is_refused(
        field: str, value: float, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               **{"sliding_window": None, field: value}).save_pretrained(tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x\n" * 200)
    line = _one_line(["train", "--model", f"hf:{tmp_path / 'model'}", "--data", str(corpus), "--cp", "2",
                      "--seq-len", "16", "--out", str(tmp_path / "o")], capsys)
    assert words in line, line


def test_layers_whose_mask_the_ring_does_not_build_are_refused() -> None:
    from types import SimpleNamespace

    from plait.errors import PlaitError
    from plait.models.hf.context import check_layer_kinds

    class Llama4Like(torch.nn.Module):
        config = SimpleNamespace(layer_types=["full_attention", "chunked_attention"])

    with pytest.raises(PlaitError, match="Llama4Like has chunked_attention layers, whose mask context parallelism "
                                         "does not build"):
        check_layer_kinds(Llama4Like())
    Llama4Like.config = SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    check_layer_kinds(Llama4Like())  # the causal mask and a sliding window's, both built under cp


def test_memory_limit_refuses_a_model_it_cannot_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(["train", "--model", "resnet18", "--data", "digits", "--memory-limit", "1", "--out",
                      str(tmp_path)], capsys)
    assert "--memory-limit compares plait estimate's memory per rank, and it has no estimate for --model resnet18" in line


def test_memory_limit_names_the_cp_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's long-sequence demo: one process would need 0.37 GiB (its peak); cp 2 fits 0.3."""
    argv = ["train", "--model", "small,max_seq_len=2048", "--seq-len", "2048", "--micro-batch", "1",
            "--memory-limit", "0.3", "--out", str(tmp_path)]
    assert main([*argv, "--nproc", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "plait: error: dp=1 tp=1 pp=1 needs an estimated 0.37 GiB per rank, more than --memory-limit 0.3 GiB",
        "  hint: add --cp 2 (--nproc 2): each rank then holds 1/2 of every sequence"]
    from plait.train.config.settings import build_config
    from plait.train.config.memory_limit import check_memory_limit
    from plait.families import family_of

    config = build_config({}, {"model": "small,max_seq_len=2048", "seq_len": 2048, "micro_batch": 1, "cp": 2,
                               "nproc": 2, "memory_limit": 0.3}, family_of)
    check_memory_limit(config, family_of(config).memory)  # fits: no error


def test_memory_limit_prices_the_document_mask_the_run_will_build(tmp_path: Path) -> None:
    """--doc-mask true on a CPU: --memory-limit's price holds SDPA's dense b·s² mask (16 MiB at
    2048 tokens in fp32) and the rope rows of every token, as `plait estimate --doc-mask dense`
    does. "auto" masks a prepared corpus of completions (its index says so before a token is
    read), not plain text: priced so, where it was priced without a mask whatever the corpus."""
    import json

    from plait.estimate import estimate_layout
    from plait.estimate.layout import Workload
    from plait.families import family_of, shape_of
    from plait.train.config.settings import build_config
    from plait.train.data.prepare import prepare

    corpora = {}
    for kind, record in (("completion", {"prompt": "a question ", "completion": "its answer"}),
                         ("text", {"text": "a document of plain text"})):
        (tmp_path / f"{kind}.jsonl").write_text("\n".join(json.dumps(record) for _ in range(40)) + "\n")
        prepare("bytes", str(tmp_path / f"{kind}.jsonl"), str(tmp_path / kind))
        corpora[kind] = str(tmp_path / kind)
    price, configs = {}, {}
    for data in ("embedded", corpora["text"], corpora["completion"]):
        for mask in ("false", "true", "auto"):
            configs[mask, data] = build_config({}, {"model": "small,max_seq_len=2048", "seq_len": 2048,
                                                    "micro_batch": 1, "doc_mask": mask, "data": data}, family_of)
            price[mask, data] = family_of(configs[mask, data]).memory(configs[mask, data], configs[mask, data].layout)
    config = configs["true", "embedded"]
    work = Workload.of(config.layout, **config.work(), doc_mask="dense")
    masked = estimate_layout(shape_of(config.model), work, hardware="cpu")["memory"]
    assert price["true", "embedded"] == float(masked.get("peak") or masked["total"])
    for data in ("embedded", corpora["text"], corpora["completion"]):
        assert price["true", data] - price["false", data] > 2048 ** 2 * 4
        assert price["auto", data] == price["true" if data == corpora["completion"] else "false", data], data


@pytest.mark.slow  # make test runs the same Trainer in tests/test_context_worlds.py; this adds argv and the spawn
def test_the_command_trains_a_transformers_model_under_cp_as_one_process(tmp_path: Path) -> None:
    import json

    from tests.parity import assert_losses_close
    from tests.worldlib import run_plait

    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path / "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(400)))
    common = ["train", "--model", f"hf:{tmp_path / 'llama'}", "--data", str(corpus), "--steps", "3",
              "--micro-batch", "2", "--seq-len", "32", "--eval-every", "0", "--eval-samples", "4",
              "--sample-tokens", "0", "--no-report", "--warmup-steps", "1", "--lr", "1e-3"]
    losses = {}
    for name, flags in {"one": ["--nproc", "1"], "cp2": ["--nproc", "2", "--cp", "2"],
                        "ulysses": ["--nproc", "2", "--cp", "2", "--cp-kind", "ulysses"]}.items():
        proc = run_plait(*common, *flags, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert_losses_close(losses["cp2"], losses["one"])
    assert_losses_close(losses["ulysses"], losses["one"])


def test_a_window_the_layer_declares_but_does_not_hand_over_is_refused() -> None:
    """A layer whose `sliding_window` never reaches its attention function would be trained on
    the whole causal past under cp: refused, where the window handed over is masked by."""
    from types import SimpleNamespace

    from plait.errors import PlaitError
    from plait.models.hf.context import context_forward

    class WindowedAttention(torch.nn.Module):
        sliding_window = 6

    handed = []
    context = SimpleNamespace(axis=SimpleNamespace(size=2), documents=None,
                              attend=lambda q, k, v, **kw: handed.append(kw["window"]) or q)
    q = torch.zeros(1, 4, 8, 8)  # 8 tokens a rank of a 16-token sequence
    with pytest.raises(PlaitError, match="WindowedAttention declares a sliding window of 6 tokens it does not hand "
                                         "its attention function: cp cannot mask by it"):
        context_forward(context, WindowedAttention(), q, q, q)
    context_forward(context, WindowedAttention(), q, q, q, sliding_window=6)
    assert handed == [6]

    class FullAttention(WindowedAttention):  # EXAONE MoE's full layers: the config's window, not sliding
        is_sliding = False

    context_forward(context, FullAttention(), q, q, q)
    assert handed == [6, None]


def test_ulysses_keeps_one_window_mask_a_rank_and_the_ring_none() -> None:
    """A sliding window shorter than the sequence: Ulysses keeps one additive s × s mask a rank,
    shared by its micro-batches in flight (plait.parallel.context.ulysses.window_mask); the
    ring keeps none; a window that holds the sequence, none."""
    from dataclasses import replace

    from plait.estimate.activations import stage_activation_bytes
    from plait.estimate.layout import Workload, layout_stages

    def added(window: int, **fields: object) -> float:
        layout = Workload(**{"cp": 2, "cp_kind": "ulysses", "micro_batch": 2, "seq_len": 16, "grad_accum": 2,
                             **fields})
        config = get_preset("tiny")
        stage = layout_stages(config, layout)[0]
        return (stage_activation_bytes(replace(config, sliding_window=window), layout, stage)
                - stage_activation_bytes(config, layout, stage))

    assert added(6) == 16 * 16 * 4  # fp32, once, though two micro-batches run
    assert added(6, precision="bf16") == 16 * 16 * 2
    assert added(6, cp_kind="ring") == 0
    assert added(16) == 0
    assert added(6, recompute="full") == 0
