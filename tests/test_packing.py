"""Documents as training sequences (plait/train/data/packing.py, parallel/packed.py, prepare's
--format): completion and chat records carry their loss masks; best-fit never cuts a document
that fits; with document masks every token's logits equal its document's run alone (plait's
GPT and two transformers families); `plait eval` equals transformers' own loss on each
document alone, prompts' labels at -100. Layouts are tests/test_packing_worlds.py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.errors import PlaitError
from plait.parallel.packed import IGNORE, Packed, document_numbers, run_model
from plait.train.data.corpus import map_tokens, train_val_split
from plait.train.data.packing import BestFitSplit, Packing, best_fit, resolve_packing
from plait.train.data.prepare import data_main, prepare
from plait.train.data.tokens import DOCUMENTS, LOSS_MASK, TOKENS
from tests.worldlib import run_plait

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet  # noqa: E402

PAIRS = [("What is 2+2?", " 4"), ("Name a colour.", " Blue, or red."), ("", " an empty prompt"),
         ("Say ☕", " café")] * 3
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
          {"role": "assistant", "content": "See you."}],
         [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]] * 4


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chatml_tokenizer(directory: Path) -> int:
    """A byte-level BPE whose end-of-turn mark <|im_end|> is also its eos_token (torchtitan #3130's case)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([m["content"] for chat in CHATS for m in chat] * 10, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return tokenizer.token_to_id("<|im_end|>")


def test_completion_records_are_prompt_completion_eos_with_the_loss_on_the_answer(tmp_path, capsys):
    rows = [{"prompt": p, "completion": c} for p, c in PAIRS]
    table = pa.table({"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]})
    pyarrow.parquet.write_table(table, tmp_path / "a.parquet", row_group_size=5)
    sources = {"jsonl": _jsonl(tmp_path / "a.jsonl", rows), "parquet": tmp_path / "a.parquet"}
    written = {}
    for name, source in sources.items():
        data_main(["prepare", "--tokenizer", "bytes", "--data", str(source), "--out", str(tmp_path / name)])
        written[name] = [(tmp_path / name / f).read_bytes() for f in (TOKENS, DOCUMENTS, LOSS_MASK)]
    assert "records read as completion (from the first record's keys)" in capsys.readouterr().out
    assert written["jsonl"] == written["parquet"]
    tokens = map_tokens(str(tmp_path / "jsonl"))
    ids, mask = tokens.numpy().astype(np.int64), tokens.plait_loss_mask.numpy()
    start = 0
    for (prompt, completion), end in zip(PAIRS, tokens.plait_documents.astype(int)):
        asked, answer = list(prompt.encode()), list(completion.encode())
        assert ids[start:end].tolist() == asked + answer + [256]
        assert mask[start:end].tolist() == [0] * len(asked) + [1] * (len(answer) + 1)
        start = end


def test_chat_turns_render_by_the_template_and_an_eos_delimiter_is_never_a_boundary(tmp_path, capsys):
    eos = _chatml_tokenizer(tmp_path / "tok")
    index = prepare(str(tmp_path / "tok"), str(_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])),
                    str(tmp_path / "out"))
    assert index.data_format == "chat" and index.documents == len(CHATS) and index.eos == eos
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    tokens = map_tokens(str(tmp_path / "out"))
    ids, mask, ends = tokens.numpy().astype(np.int64), tokens.plait_loss_mask.numpy(), tokens.plait_documents
    first = ids[:int(ends[0])]
    assert (first[:-1] == eos).sum() == 5  # each turn's <|im_end|>, all inside one document
    carried = tokenizer.decode(first[mask[:int(ends[0])] == 1].tolist(), skip_special_tokens=False)
    assert carried == "Hello!<|im_end|>\nSee you.<|im_end|>\n<|im_end|>"  # assistant turns, then the eos
    # under --doc-mask the boundaries are the records', whatever ids they hold
    packing = Packing("best-fit", True)
    train, _ = train_val_split(tokens, 64, val_fraction=0.0001, seed=0, packing=packing)
    inputs, _ = train.batch(list(range(train.num_samples)))
    assert int(sum(len(torch.unique(row)) for row in inputs.documents)) >= len(CHATS) - 1


def test_mixed_records_and_formats_that_cannot_apply_are_refused_in_one_line(tmp_path):
    mixed = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "completion": "b"}, {"text": "plain"}])
    with pytest.raises(PlaitError, match="mixes record formats: .*m.jsonl:2 is a text record"):
        prepare("bytes", str(mixed), str(tmp_path / "m"))
    assert not (tmp_path / "m" / TOKENS).exists()
    with pytest.raises(PlaitError, match="--format chat renders .* --tokenizer bytes has none"):
        prepare("bytes", str(_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])), str(tmp_path / "c"))
    (tmp_path / "t.txt").write_text("text\n")
    with pytest.raises(PlaitError, match="--format completion reads records"):
        prepare("bytes", str(tmp_path / "t.txt"), str(tmp_path / "t"), data_format="completion")
    with pytest.raises(PlaitError, match="needs the corpus's document boundaries"):
        resolve_packing("best-fit", "auto", documents=False, fine_tuning=False)
    bad = _jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "completion": ""}, {"prompt": 3, "completion": "x"},
                                        {"prompt": "a", "completion": "ok"}])
    index = prepare("bytes", str(bad), str(tmp_path / "b"))
    assert index.bad_records == 2 and index.documents == 1
    assert "b.jsonl:1 (empty completion)" in (tmp_path / "b" / "skipped.txt").read_text()


def test_best_fit_never_cuts_a_document_that_fits_and_keeps_every_token():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=500)
    lengths[::50] = 70  # longer than a sequence: cut into 32-token pieces
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    corpus = torch.arange(int(lengths.sum())) % 1000
    split = BestFitSplit(corpus, starts, lengths, 32, True, None, pad=999)
    assert all(len(b) for b in best_fit(np.asarray([32, 1, 31, 16, 16]), 32))
    inputs, targets = split.batch(list(range(split.num_samples)))
    seen = []
    for row, pos, tgt in zip(inputs.ids, inputs.positions, targets):
        for doc in torch.unique_consecutive(document_numbers(pos[None])[0]):
            where = (document_numbers(pos[None])[0] == doc).nonzero().flatten()
            piece = row[where]
            if piece[0] == 999 and (tgt[where] == IGNORE).all():
                continue  # the padding
            seen.append(piece.tolist())
            assert pos[where].tolist() == list(range(len(where)))
            assert tgt[where[:-1]].tolist() == piece[1:].tolist() and tgt[where[-1]] == IGNORE
    whole = [corpus[s:s + n].tolist() for s, n in zip(starts, lengths) if n <= 32]
    assert sorted(p for p in seen if len(p) < 32 or p in whole) == sorted(whole) or all(p in seen for p in whole)
    assert sum(map(len, seen)) == int(lengths.sum())
    fill = sum(map(len, seen)) / (split.num_samples * 32)
    assert fill > 0.95, fill  # best-fit decreasing packs tightly


def test_concat_windows_restart_positions_at_documents_and_never_score_across_them(tmp_path):
    prepare("bytes", str(_jsonl(tmp_path / "t.jsonl", [{"text": "ab" * k} for k in range(1, 30)])),
            str(tmp_path / "t"))
    tokens = map_tokens(str(tmp_path / "t"))
    train, _ = train_val_split(tokens, 16, seed=0, packing=Packing("concat", True))
    inputs, targets = train.batch([0, 1, 2])
    assert isinstance(inputs, Packed)
    ends = inputs.ids == 256
    assert (targets[ends] == IGNORE).all() and (targets[~ends] != IGNORE).all()
    after = torch.cat([torch.zeros(3, 1, dtype=torch.bool), ends[:, :-1]], dim=1)
    assert (inputs.positions[after] == 0).all() and (inputs.positions[:, 0] == 0).all()
    plain, _ = train_val_split(tokens, 16, seed=0)
    assert torch.equal(plain.batch([0, 1, 2])[0], inputs.ids)  # the same windows, today's


def _docs(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in (7, 12, 1, 9)]


def _packed_vs_alone(model: torch.nn.Module, vocab: int) -> float:
    docs = _docs(vocab)
    packed = Packed.of(torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None])
    with torch.no_grad():
        out = getattr(run_model(model, packed), "logits", None)
        out = run_model(model, packed) if out is None else out
        worst, at = 0.0, 0
        for d in docs:
            alone = model(d[None])
            alone = getattr(alone, "logits", alone)
            worst = max(worst, (alone[0] - out[0, at:at + len(d)]).abs().max().item())
            at += len(d)
    return worst


def test_packed_documents_give_each_tokens_logits_as_its_document_alone():
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    assert _packed_vs_alone(build_gpt(get_preset("tiny"), 0), 256) < 1e-5
    shape = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    for config in (transformers.LlamaConfig(**shape), transformers.Qwen3Config(**shape, head_dim=8)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        assert _packed_vs_alone(model, 97) < 1e-5, type(model).__name__


@pytest.fixture(scope="module")
def llama_and_corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3) for i in range(24)]
    prepare("bytes", str(_jsonl(root / "t.jsonl", [{"text": t} for t in texts])), str(root / "text"))
    prepare("bytes", str(_jsonl(root / "c.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])),
            str(root / "completion"))
    return root


def _transformers_loss(root: Path, records: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    """Token-weighted mean of transformers' own loss on each document alone (labels -100 off the mask)."""
    model = transformers.LlamaForCausalLM.from_pretrained(root / "llama").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in records:
            n = sum(1 for x in labels[1:] if x != IGNORE)
            loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
            total, count = total + loss * n, count + n
    return total / count, count


@pytest.mark.parametrize("corpus", ["text", "completion"])
def test_plait_eval_equals_transformers_loss_on_each_document_alone(llama_and_corpora, corpus):
    root = llama_and_corpora
    tokens = map_tokens(str(root / corpus))
    ids, bounds = tokens.numpy().astype(int).tolist(), [0, *tokens.plait_documents.astype(int).tolist()]
    mask = tokens.plait_loss_mask.numpy().tolist() if corpus == "completion" else [1] * len(ids)
    records = [(ids[a:b], [t if m else IGNORE for t, m in zip(ids[a:b], mask[a:b])]) for a, b in zip(bounds, bounds[1:])]
    expected, count = _transformers_loss(root, records)
    for layout in (["--nproc", "1"], ["--nproc", "2", "--pp", "2", "--micro-batch", "3"]):
        proc = run_plait("eval", "--model", f"hf:{root / 'llama'}", "--data", str(root / corpus), "--seq-len", "96",
                         "--json", *layout)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["tokens"] == count and result["documents"] == len(records)
        assert abs(result["loss"] - expected) < 1e-5 * expected, (layout, result, expected)


def test_packed_training_resumes_exactly_after_an_epoch(tmp_path):
    from tests.worldlib import run_losses

    rows = [{"prompt": f"q{i} " * (1 + i % 4), "completion": f" a{i}" * (1 + i % 3)} for i in range(24)]
    prepare("bytes", str(_jsonl(tmp_path / "c.jsonl", rows)), str(tmp_path / "c"))
    common = ["--data", str(tmp_path / "c"), "--model", "tiny", "--steps", "6", "--seq-len", "32", "--micro-batch",
              "4", "--nproc", "1", "--eval-every", "0", "--eval-samples", "2", "--sample-tokens", "0"]
    whole = run_plait("train", *common, "--save-every", "4", "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    resumed = run_plait("train", *common, "--out", str(tmp_path / "resumed"),
                        "--resume", str(tmp_path / "whole" / "checkpoints" / "step-00000004"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert run_losses(tmp_path / "resumed") == run_losses(tmp_path / "whole")[4:]
    tokens = map_tokens(str(tmp_path / "c"))
    train, _ = train_val_split(tokens, 32, seed=0, packing=Packing("best-fit", True))
    assert 4 <= train.num_samples < 16, train.num_samples  # so the resume crosses an epoch's end


def test_a_model_that_lets_packed_documents_see_each_other_is_refused(tmp_path):
    """Qwen3-Next's linear-attention layers carry their state along the sequence whatever the
    positions say: the check before training finds a packed document scoring otherwise than
    alone, and --doc-mask is refused in one line (Llama, beside it, passes and trains)."""
    rows = [{"prompt": f"q{i} ", "completion": f" a{i}"} for i in range(40)]
    prepare("bytes", str(_jsonl(tmp_path / "c.jsonl", rows)), str(tmp_path / "c"))
    shape = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, max_position_embeddings=64)
    transformers.AutoConfig.for_model(
        "qwen3_next", **shape, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts_per_tok=2, moe_intermediate_size=32).save_pretrained(tmp_path / "qwen3_next")
    transformers.LlamaConfig(**shape, num_hidden_layers=2).save_pretrained(tmp_path / "llama")
    common = ["--data", str(tmp_path / "c"), "--steps", "1", "--seq-len", "32", "--micro-batch", "2", "--nproc", "1",
              "--eval-every", "0", "--eval-samples", "2", "--sample-tokens", "0", "--no-report"]
    refused = run_plait("train", "--model", f"hf:{tmp_path / 'qwen3_next'}", *common, "--out", str(tmp_path / "q"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--doc-mask: --model hf:" in refused.stderr and "does not keep packed documents apart" in refused.stderr
    assert "hint: train it with --doc-mask false" in refused.stderr
    passed = run_plait("train", "--model", f"hf:{tmp_path / 'llama'}", *common, "--out", str(tmp_path / "l"))
    assert passed.returncode == 0, passed.stderr[-2000:]


def test_the_gpus_flexattention_block_mask_is_the_cpus_boolean_one():
    """On a GPU documents are masked by FlexAttention's block mask (compiled there; the CPU has
    no FlexAttention backward): its forward on this CPU, eager, equals SDPA's boolean mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from plait.parallel.packed import block_causal, flex_block_mask

    gen = torch.Generator().manual_seed(0)
    documents = document_numbers(torch.cat([torch.arange(n) for n in (20, 1, 30, 13)])[None]).expand(2, -1)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=flex_block_mask(documents, 64))
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=block_causal(documents, documents,
                                                                                                True))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    assert flex_block_mask(documents.clone(), 64) is flex_block_mask(documents, 64)  # one mask for a forward's layers
