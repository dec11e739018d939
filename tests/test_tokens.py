"""Prepared corpora: `plait data prepare`, a token file every rank maps, and its checks.

The tests make their own data: a corpus larger than the 8 MiB raw-text limit (bytes), and a
BPE tokenizer trained here with `tokenizers` on a small text (a vocabulary that is not 256).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli import main as plait_main
from plait.errors import PlaitError
from plait.families import family_of
from plait.train.config.settings import build_config, validate
from plait.train.data.corpus import RAW_LIMIT, StepSampler, load_corpus, raw_files, train_val_split
from plait.train.data.prepare import prepare
from plait.train.data.tokens import INDEX, TOKENS, VERIFIED, check_tokens, model_for_data, text_codec
from tests.worldlib import run_plait

SEQ = 1024


def checked(flags: dict) -> None:
    """`plait train`'s checks of these flags before it spawns."""
    config = build_config({}, flags, family_of)
    validate(config, family_of(config))


def rss_bytes() -> int:
    """Resident set size now (Linux): what a read corpus would grow and a mapped one not."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 9 MiB text file (over the raw limit) and its prepared directory."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    text = rng.integers(32, 127, size=9 * 2**20, dtype=np.uint8)
    text[rng.integers(0, text.size, size=text.size // 60)] = ord("\n")
    source = root / "corpus.txt"
    source.write_bytes(text.tobytes())
    prepare("bytes", str(source), str(root / "prepared"))
    return source, root / "prepared"


def test_raw_text_over_the_limit_is_refused_not_cut(big: tuple[Path, Path]) -> None:
    source, _ = big
    assert source.stat().st_size > RAW_LIMIT
    for attempt in (lambda: raw_files(str(source)), lambda: load_corpus(str(source)),
                    lambda: checked({"data": str(source), "nproc": 1})):
        with pytest.raises(PlaitError) as err:
            attempt()
        assert "9.0 MiB" in err.value.message and "8 MiB" in err.value.message
        assert f"plait data prepare --tokenizer bytes --data {source}" in err.value.hint


def test_prepared_corpus_is_mapped_and_used_whole(big: tuple[Path, Path]) -> None:
    source, prepared = big
    index = json.loads((prepared / INDEX).read_text())
    raw = np.fromfile(source, dtype=np.uint8)
    assert (index["dtype"], index["count"], index["vocab_size"]) == ("uint16", raw.size, 256)
    assert (prepared / TOKENS).stat().st_size == 2 * raw.size
    (prepared / VERIFIED).unlink(missing_ok=True)  # the first load hashes the whole file

    def use(tokens: torch.Tensor) -> tuple:
        """What training asks of a corpus: split, an epoch of the sampler, the last sample."""
        train, val = train_val_split(tokens, SEQ)
        sampler = StepSampler(train.num_samples, global_batch=8, dp_rank=0, dp_size=1, micro_batch=4, seed=0)
        seen = {i for step in range(sampler.steps_per_epoch) for mb in sampler.micro_batches(step) for i in mb}
        return train, val, sampler, seen, train.batch([train.num_samples - 1])

    use(torch.zeros(2 * 2**20, dtype=torch.uint16))  # warm-up: torch's one-off allocations
    before = rss_bytes()
    tokens = load_corpus(str(prepared))
    train, val, sampler, seen, (inputs, targets) = use(tokens)
    mapped = rss_bytes() - before
    # The kernel's own word that the file is mapped, not copied in: it is in this process's
    # address space as a file mapping while the tensor lives (a read would leave no such line).
    maps = Path("/proc/self/maps").read_text()

    assert (prepared / VERIFIED).exists()
    assert len(tokens) == raw.size and len(train.tokens) + len(val.tokens) == raw.size
    last = train.num_samples - 1
    assert last in seen and len(seen) == sampler.steps_per_epoch * 8
    assert train.num_samples == (len(train.tokens) - 1) // SEQ > (RAW_LIMIT // SEQ)
    np.testing.assert_array_equal(inputs[0].numpy(), raw[last * SEQ: last * SEQ + SEQ])
    np.testing.assert_array_equal(targets[0].numpy(), raw[last * SEQ + 1: last * SEQ + SEQ + 1])
    # Mapped, not read: the 18 MiB token file adds a few pages, where reading it adds itself.
    size = (prepared / TOKENS).stat().st_size
    assert str((prepared / TOKENS).resolve()) in maps, "the token file is not memory-mapped"
    assert mapped < 4 * 2**20, f"RSS grew {mapped / 2**20:.1f} MiB for an {size / 2**20:.0f} MiB file"


def test_a_damaged_token_file_is_refused_naming_it(big: tuple[Path, Path], tmp_path: Path) -> None:
    _, prepared = big
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in (INDEX, TOKENS):
        (copy / name).write_bytes((prepared / name).read_bytes())
    check_tokens(copy)  # sound: hashed once, remembered
    assert (copy / VERIFIED).exists()
    path = copy / TOKENS
    with open(path, "r+b") as handle:  # one byte in the middle: only the full hash sees it
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 1]))
    check_tokens(copy, full=False)  # the cheap check cannot tell
    with pytest.raises(PlaitError, match=f"token file {path} is damaged: its sha256"):
        load_corpus(str(copy))
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 2)
    with pytest.raises(PlaitError, match=f"token file {path} is damaged: .* bytes where the index says"):
        check_tokens(copy, full=False)


def bpe_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer trained on a small text; writes directory/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def test_bpe_corpus_prepared_and_trained_with_the_model_following_its_vocabulary(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    vocab = bpe_tokenizer(tmp_path / "tok")
    assert vocab != 256
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(3):
        (corpus / f"part{k}.py").write_text("".join(f"def g{i}(y):\n    return y - {i * k}\n" for i in range(800)))
    out = tmp_path / "prepared"
    assert plait_main(["data", "prepare", "--tokenizer", str(tmp_path / "tok"), "--data", str(corpus),
                       "--out", str(out)]) == 0
    assert "vocabulary" in capsys.readouterr().out
    index = json.loads((out / INDEX).read_text())
    assert (index["dtype"], index["vocab_size"]) == ("uint16", vocab) and (out / "tokenizer.json").exists()
    tokens = load_corpus(str(out))
    assert int(tokens.long().max()) < vocab and len(tokens) == index["count"]
    codec = text_codec(str(out))
    assert codec.decode(codec.encode("def g5(y):")) == "def g5(y):"

    assert model_for_data("tiny", str(out)) == f"tiny,vocab_size={vocab}"
    assert model_for_data(f"tiny,vocab_size={vocab + 4}", str(out)) == f"tiny,vocab_size={vocab + 4}"
    with pytest.raises(PlaitError, match=f"vocab_size 256, fewer than the {vocab} token ids"):
        model_for_data("tiny,vocab_size=256", str(out))

    run_out = tmp_path / "run"
    proc = run_plait("train", "--data", str(out), "--model", "tiny", "--nproc", "1", "--steps", "2",
                     "--seq-len", "32", "--micro-batch", "2", "--eval-every", "0", "--eval-samples", "2",
                     "--sample-tokens", "8", "--out", str(run_out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_out / "summary.json").read_text())
    assert summary["config"]["model"] == f"tiny,vocab_size={vocab}"
    first = json.loads((run_out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(np.log(vocab), rel=0.05)  # a fresh model guesses over the whole vocabulary
    assert summary["sample"].startswith("def ")


def test_the_sampler_reads_its_step_from_the_permutation_as_shard_indices_deals_it() -> None:
    from plait.train.data.corpus import shard_indices

    for dp, micro, accum in ((1, 4, 1), (2, 2, 2), (4, 1, 3)):
        sampler = StepSampler(1000, global_batch=dp * micro * accum, dp_rank=dp - 1, dp_size=dp,
                              micro_batch=micro, seed=3)
        local = micro * accum
        for step in (0, 7, sampler.steps_per_epoch - 1, sampler.steps_per_epoch + 2):
            epoch, pos = sampler.position(step)
            dealt = shard_indices(1000, (dp - 1, dp), 3, epoch, block=local)[pos * local: (pos + 1) * local]
            assert [i for mb in sampler.micro_batches(step) for i in mb] == dealt


def test_a_vocabulary_over_65536_is_stored_and_mapped_as_uint32(tmp_path: Path) -> None:
    import hashlib

    from plait.train.data.tokens import TokenIndex, dtype_for, edges_digest, write_index

    assert (dtype_for(256), dtype_for(65536), dtype_for(65537)) == ("uint16", "uint16", "uint32")
    ids = np.arange(70_000, 70_000 + 5000, dtype="<u4")
    (tmp_path / TOKENS).write_bytes(ids.tobytes())
    with open(tmp_path / TOKENS, "rb") as handle:
        edges = edges_digest(handle, ids.nbytes)
    write_index(tmp_path, TokenIndex(dtype="uint32", count=ids.size, vocab_size=80_000, tokenizer="test",
                                     source="test", sha256=hashlib.sha256(ids.tobytes()).hexdigest(),
                                     edges_sha256=edges))
    tokens = load_corpus(str(tmp_path))
    assert tokens.dtype == torch.uint32 and len(tokens) == ids.size
    np.testing.assert_array_equal(tokens[-3:].long().numpy(), ids[-3:])
    assert model_for_data("tiny", str(tmp_path)) == "tiny,vocab_size=80000"
