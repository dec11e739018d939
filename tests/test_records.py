"""Corpora of records (plait/train/data/records.py, prepare.py): jsonl, jsonl.gz, parquet and a
`datasets` folder prepare to the same bytes, each record one document ended by EOS; bad
records are named, never dropped in silence; held-out documents are whole and stable."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from plait.errors import PlaitError
from plait.train.data.corpus import (DocumentSplit, document_runs, held_out_documents, map_tokens,
                                     train_val_split)
from plait.train.data.prepare import SKIPPED, data_main, prepare
from plait.train.data.tokens import DOCUMENTS, INDEX, TOKENS, raw_files

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet  # noqa: E402

TEXTS = ["hello world", "a second, longer document\nwith two lines", "naïve café ☕", "x" * 300, "last one"]


def write_all_formats(root: Path, texts: list[str]) -> dict[str, Path]:
    """The same records as jsonl, jsonl.gz, parquet and a save_to_disk folder (written as
    `datasets` writes it: Arrow stream files named by state.json)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (root / "a.jsonl").write_text(lines)
    with gzip.open(root / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    table = pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows]})
    pyarrow.parquet.write_table(table, root / "a.parquet", row_group_size=2)
    folder = root / "saved"
    folder.mkdir()
    halves = [table.slice(0, 3), table.slice(3)]
    for k, part in enumerate(halves):
        with pa.OSFile(str(folder / f"data-{k:05d}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, part.schema) as writer:
                writer.write_table(part, max_chunksize=2)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{k:05d}-of-00002.arrow"}
                                                                   for k in range(2)]}))
    (folder / "dataset_info.json").write_text("{}")
    return {"jsonl": root / "a.jsonl", "jsonl.gz": root / "a.jsonl.gz", "parquet": root / "a.parquet",
            "datasets": folder}


def bpe_with_eos(directory: Path) -> int:
    """A byte-level BPE tokenizer with an end-of-sequence token its tokenizer_config.json names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return tokenizer.token_to_id("</s>")


def _files(directory: Path) -> tuple[bytes, bytes]:
    return (directory / TOKENS).read_bytes(), (directory / DOCUMENTS).read_bytes()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_every_format_prepares_to_the_same_bytes_each_record_a_document(tmp_path, tokenizer):
    sources = write_all_formats(tmp_path / "in", TEXTS)
    spec, eos = "bytes", 256
    if tokenizer == "bpe":
        eos = bpe_with_eos(tmp_path / "tok")
        spec = str(tmp_path / "tok")
    prepared = {kind: tmp_path / kind for kind in sources}
    for kind, source in sources.items():
        index = prepare(spec, str(source), str(prepared[kind]))
        assert (index.documents, index.eos, index.bad_records) == (len(TEXTS), eos, 0)
    first = _files(prepared["jsonl"])
    for kind in sources:
        assert _files(prepared[kind]) == first, kind
    dtype = json.loads((prepared["jsonl"] / INDEX).read_text())["dtype"]
    ids = np.frombuffer(first[0], dtype="<u2" if dtype == "uint16" else "<u4")
    ends = np.frombuffer(first[1], dtype="<u8").astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    for text, start, end in zip(TEXTS, starts, ends):
        doc = ids[start:end]
        assert doc[-1] == eos and eos not in doc[:-1]
        if tokenizer == "bytes":
            assert bytes(doc[:-1].astype(np.uint8)) == text.encode()


def test_two_workers_write_what_one_writes(tmp_path):
    source = write_all_formats(tmp_path / "in", TEXTS * 300)["jsonl"]
    bpe_with_eos(tmp_path / "tok")
    prepare(str(tmp_path / "tok"), str(source), str(tmp_path / "one"), workers=1)
    prepare(str(tmp_path / "tok"), str(source), str(tmp_path / "two"), workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_bad_records_are_counted_and_named_and_the_rest_kept(tmp_path, capsys):
    source = tmp_path / "mixed.jsonl"
    source.write_bytes(b'{"text": "good"}\nnot json\n[1, 2]\n{"other": "x"}\n{"text": 5}\n{"text": ""}\n\n'
                       b'\xff\xfe{"text": "bad bytes"}\n{"text": "also good"}\n')
    assert data_main(["prepare", "--tokenizer", "bytes", "--data", str(source), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "skipped 6 bad record(s)" in printed and f"{source}:2 (not JSON)" in printed
    named = (tmp_path / "out" / SKIPPED).read_text().splitlines()
    assert named == [f"{source}:2 (not JSON)", f"{source}:3 (a JSON list, not an object)",
                     f"{source}:4 (no field 'text')", f"{source}:5 (field 'text' is int, not a string)",
                     f"{source}:6 (empty document)", f"{source}:8 (not UTF-8)"]
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert (index["documents"], index["bad_records"]) == (2, 6)


def test_a_file_with_nothing_usable_is_refused_naming_it(tmp_path):
    sources = write_all_formats(tmp_path / "in", TEXTS)
    with pytest.raises(PlaitError, match=r"a\.parquet holds no usable record: 5 bad, e\.g\. .*row 4 \(no field 'body'\)"):
        prepare("bytes", str(sources["parquet"]), str(tmp_path / "out"), text_field="body")
    with pytest.raises(PlaitError, match=r"holds no usable record: 5 bad.*field 'id' is int"):
        prepare("bytes", str(sources["datasets"]), str(tmp_path / "out"), text_field="id")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PlaitError, match="holds no usable record \\(it is empty\\)"):
        prepare("bytes", str(empty), str(tmp_path / "out"))
    assert not (tmp_path / "out" / TOKENS).exists()  # nothing that looks prepared is left


def test_records_are_refused_as_raw_text_and_bad_options_in_one_line(tmp_path):
    source = write_all_formats(tmp_path / "in", TEXTS)["jsonl"]
    with pytest.raises(PlaitError, match="holds records .* prepare them first"):
        raw_files(str(source))
    with pytest.raises(PlaitError, match="--workers 0"):
        prepare("bytes", str(source), str(tmp_path / "out"), workers=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(PlaitError, match="is a file"):
        prepare("bytes", str(source), str(tmp_path / "file"))
    with pytest.raises(PlaitError, match="no end-of-sequence token"):
        tok = tmp_path / "tok"
        bpe_with_eos(tok)
        (tok / "tokenizer_config.json").unlink()
        prepare(str(tok), str(source), str(tmp_path / "out"))


def test_held_out_documents_are_whole_stable_under_the_seed_and_never_the_tail(tmp_path):
    texts = [f"doc {i} " + "w" * (i % 13) for i in range(400)]
    source = write_all_formats(tmp_path / "in", texts)["jsonl"]
    prepare("bytes", str(source), str(tmp_path / "out"))
    tokens = map_tokens(str(tmp_path / "out"))
    ends = tokens.plait_documents.astype(np.int64)
    held = held_out_documents(len(ends), 0.05, seed=3)
    assert np.array_equal(held, held_out_documents(len(ends), 0.05, seed=3))
    assert not np.array_equal(held, held_out_documents(len(ends), 0.05, seed=4))
    assert 8 <= held.sum() <= 35 and held[:200].any()  # about 5%, spread over the stream
    train, val = train_val_split(tokens, 16, seed=3)
    assert isinstance(train, DocumentSplit) and len(train) + len(val) == len(tokens)
    starts = np.concatenate([[0], ends[:-1]])
    held_tokens = torch.cat([tokens[int(s):int(e)] for s, e, h in zip(starts, ends, held) if h])
    assert torch.equal(val.window(0, len(val)), held_tokens)  # the held-out stream is exactly those documents
    inputs, targets = train.batch([0, 3, train.num_samples - 1])
    stream = train.window(0, len(train))
    assert torch.equal(inputs[1], stream[48:64].long()) and torch.equal(targets[1], stream[49:65].long())
    assert document_runs(np.array([3, 5, 9, 12], dtype=np.uint64), np.array([True, True, False, True])).tolist() == \
        [[0, 5], [9, 12]]


def test_training_on_documents_is_layout_free_and_evaluates_the_held_out_ones(tmp_path):
    """dp 2 and one process with accumulation read the same document windows: the same losses."""
    from tests.parity import assert_losses_close
    from tests.worldlib import run_losses, run_plait

    texts = [f"record {i}: " + "the quick brown fox " * (1 + i % 9) for i in range(300)]
    prepare("bytes", str(write_all_formats(tmp_path / "in", texts)["jsonl"]), str(tmp_path / "data"))
    common = ["--data", str(tmp_path / "data"), "--model", "tiny", "--steps", "3", "--seq-len", "32", "--eval-every", "0",
              "--eval-samples", "4", "--sample-tokens", "0", "--warmup-steps", "1"]
    one = run_plait("train", *common, "--nproc", "1", "--micro-batch", "4", "--grad-accum", "2", "--out",
                    str(tmp_path / "one"))
    two = run_plait("train", *common, "--nproc", "2", "--dp", "2", "--micro-batch", "4", "--out", str(tmp_path / "two"))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert_losses_close(run_losses(tmp_path / "two"), run_losses(tmp_path / "one"), rtol=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["config"]["model"].endswith("vocab_size=257") and 0 < summary["val_loss"] < 10


# -- blends ----------------------------------------------------------------------------------------
def test_blend_specs_parse_and_bad_ones_are_one_line():
    from plait.train.data.tokens import BlendPart, blend_parts

    assert blend_parts("data/web") is None and blend_parts("embedded") is None
    assert blend_parts("0.7:a,0.3:b") == [BlendPart(0.7, "a"), BlendPart(0.3, "b")]
    assert blend_parts("2:a") == [BlendPart(2.0, "a")]
    for bad, why in (("0.7:a,b", "every corpus as WEIGHT:CORPUS"), ("0:a,1:b", "positive weight"),
                     ("1:a,1:a", "names a corpus twice"), ("0.5:,0.5:b", "positive weight and a corpus")):
        with pytest.raises(PlaitError, match=why):
            blend_parts(bad)


def _constant_split(token: int, samples: int, seq: int = 4) -> "Any":
    from plait.train.data.corpus import Split

    return Split(torch.full((samples * seq + 1,), token, dtype=torch.int64), seq)


def test_a_blend_over_1000_steps_holds_its_weights_on_any_layout():
    """Every row of 1,000 steps of 8 sequences, counted by the corpus it came from: within 0.5%
    of 0.6 / 0.3 / 0.1; dp 2 deals the same rows to its ranks as one process with two micro-batches."""
    from plait.train.data.blend import BlendSplit
    from plait.train.data.corpus import StepSampler

    blend = BlendSplit([_constant_split(1, 37), _constant_split(2, 11), _constant_split(3, 5)], [6, 3, 1],
                       seed=0, shuffle=True)
    one = StepSampler(blend.num_samples, 8, 0, 1, 4, 0, ordered=True)
    dp = [StepSampler(blend.num_samples, 8, r, 2, 4, 0, ordered=True) for r in range(2)]
    seen = torch.zeros(4, dtype=torch.float64)
    for step in range(1000):
        rows = [i for micro in one.micro_batches(step) for i in micro]
        assert rows == [i for sampler in dp for micro in sampler.micro_batches(step) for i in micro]
        inputs, _ = blend.batch(rows)
        seen += torch.bincount(inputs[:, 0], minlength=4)
    shares = (seen[1:] / seen.sum()).tolist()
    assert all(abs(got - want) < 0.005 for got, want in zip(shares, [0.6, 0.3, 0.1])), shares
    assert blend.realised(8000) == pytest.approx(shares, abs=1e-12)
    assert [blend.counts(n) for n in (0, 1, 2)] == [[0, 0, 0], [1, 0, 0], [1, 1, 0]]


def test_each_corpus_deals_its_samples_once_an_epoch_and_the_held_out_blend_never_repeats():
    from plait.train.data.blend import BlendSplit

    a, b = _constant_split(1, 10), _constant_split(2, 10)
    a.tokens[:] = torch.arange(len(a.tokens))  # sample j of corpus a starts with 4j
    blend = BlendSplit([a, b], [1, 1], seed=3, shuffle=True)
    firsts = [int(blend.batch([n])[0][0, 0]) for n in range(40)]
    from_a = [f // 4 for f in firsts if f % 4 == 0 and f > 1 or f == 0]
    assert sorted(from_a[:10]) == list(range(10)) and sorted(from_a[10:20]) == list(range(10))
    held = BlendSplit([a, _constant_split(2, 3)], [1, 1], seed=3, shuffle=False)
    assert held.num_samples == 7 and held.counts(held.num_samples) == [4, 3]


def test_a_blend_trains_resumes_exactly_and_reports_its_shares(tmp_path):
    from tests.worldlib import run_losses, run_plait

    prepare("bytes", str(write_all_formats(tmp_path / "a", [f"web page {i} " * 9 for i in range(200)])["jsonl"]),
            str(tmp_path / "web"))
    prepare("bytes", str(write_all_formats(tmp_path / "b", [f"def f{i}(): pass\n" * 4 for i in range(200)])["jsonl"]),
            str(tmp_path / "code"))
    data = f"0.7:{tmp_path / 'web'},0.3:{tmp_path / 'code'}"
    common = ["--data", data, "--model", "tiny", "--steps", "4", "--seq-len", "32", "--micro-batch", "4",
              "--nproc", "1", "--eval-every", "0", "--eval-samples", "4", "--sample-tokens", "0"]
    whole = run_plait("train", *common, "--save-every", "2", "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    resumed = run_plait("train", *common, "--out", str(tmp_path / "resumed"),
                        "--resume", str(tmp_path / "whole" / "checkpoints" / "step-00000002"))
    assert resumed.returncode == 0, resumed.stderr
    assert run_losses(tmp_path / "resumed") == run_losses(tmp_path / "whole")[2:]
    assert "data blend  " in whole.stdout and "(asked 70.0%)" in whole.stdout
    blend = json.loads((tmp_path / "whole" / "summary.json").read_text())["blend"]
    assert blend["samples"] == 16 and [p["weight"] for p in blend["parts"]] == pytest.approx([0.7, 0.3])


def test_a_blend_of_different_tokens_is_refused_naming_both(tmp_path):
    from plait.families.language import check_corpus

    prepare("bytes", str(write_all_formats(tmp_path / "a", TEXTS)["jsonl"]), str(tmp_path / "records"))
    text = tmp_path / "plain.txt"
    text.write_text("some plain text " * 50)
    with pytest.raises(PlaitError, match="blends corpora of different tokens: .*vocabulary 257.*vocabulary 256"):
        check_corpus(f"1:{tmp_path / 'records'},1:{text}")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "x"}\n')
    (mixed / "notes.txt").write_text("y")
    with pytest.raises(PlaitError, match="holds records and text files"):
        prepare("bytes", str(mixed), str(tmp_path / "out"))
