"""The sampler: the same samples per step for every layout, each once per epoch, resumable."""

from __future__ import annotations

import hashlib

import pytest
import torch

from plait.errors import PlaitError
from plait.train.data.corpus import StepSampler, load_corpus, shard_indices, train_val_split


def step_samples(n, global_batch, dp, micro, step, seed=3):
    """All samples of `step` over all dp ranks, as each rank's list of micro-batches."""
    return [StepSampler(n, global_batch, r, dp, micro, seed).micro_batches(step) for r in range(dp)]


@pytest.mark.parametrize("dp, micro", [(1, 8), (1, 1), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_every_layout_sees_the_same_samples_each_step(dp, micro):
    reference = [sorted(i for mb in step_samples(1000, 8, 1, 8, s)[0] for i in mb) for s in range(5)]
    for step in range(5):
        got = sorted(i for rank in step_samples(1000, 8, dp, micro, step) for mb in rank for i in mb)
        assert got == reference[step]


def test_micro_batches_are_cut_like_one_process_with_accumulation():
    # dp=2 with micro-batch 4 holds exactly micro-batches 0 and 1 of one process with accumulation 2.
    single = step_samples(1000, 8, 1, 4, step=2)[0]
    dp2 = [rank[0] for rank in step_samples(1000, 8, 2, 4, step=2)]
    assert dp2 == single


def test_each_sample_once_per_epoch_and_a_new_order_next_epoch():
    sampler = StepSampler(100, 10, 0, 1, 10, seed=0)
    epoch0 = [i for s in range(10) for i in sampler.micro_batches(s)[0]]
    epoch1 = [i for s in range(10, 20) for i in sampler.micro_batches(s)[0]]
    assert sorted(epoch0) == list(range(100)) == sorted(epoch1)
    assert epoch0 != epoch1
    assert sampler.position(13) == (1, 3)


def test_resume_from_a_position_gives_the_same_batches():
    a = StepSampler(500, 16, 1, 2, 4, seed=9)
    b = StepSampler(500, 16, 1, 2, 4, seed=9)  # a fresh process, resuming at step 40
    assert [a.micro_batches(s) for s in range(40, 45)] == [b.micro_batches(s) for s in range(40, 45)]


def test_shard_indices_partitions_an_epoch():
    parts = [shard_indices(103, (r, 4), seed=1, epoch=0) for r in range(4)]
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 100  # the 3-sample tail is dropped, evenly
    assert all(len(p) == 25 for p in parts)


def test_too_few_samples_for_the_global_batch_is_named():
    with pytest.raises(PlaitError, match="the corpus gives 5 samples, fewer than the global batch of 8"):
        StepSampler(5, 8, 0, 1, 8, seed=0)


def test_windows_are_next_token_pairs():
    tokens = torch.arange(50, dtype=torch.uint8)
    train, val = train_val_split(tokens, seq_len=4, val_fraction=0.2)
    assert (len(train.tokens), len(val.tokens)) == (40, 10)
    x, y = train.batch([0, 2])
    assert x.tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert y.tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert train.num_samples == 9


# The default corpus's bytes: the committed loss curves (tests/golden/) hold on any machine
# because these do. Changing the shipped file changes every curve, and must change this too.
EMBEDDED_6b222c9a7ac7e21b6d85bb8b6160a9bf0315c5be573276ca359a1f55b8daf486256 = "6b222c9a7ac7e21b6d85bb8b6160a9bf0315c5be573276ca359a1f55b8daf486"


def test_the_embedded_corpus_is_the_same_frozen_text_on_every_machine():
    corpus = load_corpus()
    text = bytes(corpus.tolist())
    assert len(corpus) == 1_290_636 and hashlib.sha256(text).hexdigest() == EMBEDDED_6b222c9a7ac7e21b6d85bb8b6160a9bf0315c5be573276ca359a1f55b8daf486256
    assert b"def " in text and b"# " in text  # plait's Python source and its documentation
    assert torch.equal(load_corpus(max_bytes=1000), corpus[:1000])


def test_stdlib_corpus_is_real_python_and_deterministic():
    a, b = load_corpus("stdlib", max_bytes=200_000), load_corpus("stdlib", max_bytes=200_000)
    assert len(a) == 200_000 and torch.equal(a, b)
    assert b"def " in bytes(a[:200_000].tolist())


def test_corpus_from_a_file_and_missing_paths(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("hello world\n" * 10)
    assert len(load_corpus(str(path))) == 120
    with pytest.raises(PlaitError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.txt"))
