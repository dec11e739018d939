"""Blends: `--data 0.7:DIR_A,0.3:DIR_B` draws every global batch from several corpora in fixed shares.

The shares are made whole over a period of P = 10,000 samples: each corpus gets
round(weight · P) of them (largest remainders, so they sum to P), and the order within a
period is smooth weighted round robin (each slot goes to the corpus furthest behind its
share: the largest deficit). So the first n samples of the run hold each corpus's share to
within one sample per corpus plus the rounding to 1/P, and which corpus global sample n comes
from, and which of that corpus's samples it is (the k-th it has given), follow from n alone:

    corpus(n) = order[n mod P]
    k(n)      = (n div P) · quota[corpus] + earlier[n mod P]

Each corpus deals its own samples as a single corpus does (one permutation of them per epoch,
fixed by the seed, its own epochs as it runs out), so a blend is layout-free (every rank
computes the same n → sample map; dp rank r of step s takes samples s·G + r·G/dp onwards, as
plait.train.data.corpus.StepSampler deals a single corpus) and resumes from the step alone.
The held-out split blends the corpora's own held-out samples by the same rule, in order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from plait.errors import PlaitError
from plait.train.data.corpus import corpus_digest, epoch_permutation, load_corpus, train_val_split
from plait.train.data.packing import packing_for, stack_rows
from plait.train.data.tokens import BlendPart, blend_parts

PERIOD = 10_000  # the samples over which the shares are whole numbers


def quotas(weights: list[float], period: int = PERIOD) -> list[int]:
    """Each corpus's samples per period: weight / total · period, rounded by largest remainders."""
    total = sum(weights)
    exact = [w / total * period for w in weights]
    whole = [int(x) for x in exact]
    for c in sorted(range(len(exact)), key=lambda c: whole[c] - exact[c])[:period - sum(whole)]:
        whole[c] += 1
    return whole


def slot_order(quota: list[int]) -> np.ndarray:
    """The corpus of each slot of a period: smooth weighted round robin (the largest deficit)."""
    period, current = sum(quota), [0] * len(quota)
    order = np.empty(period, dtype=np.int64)
    for slot in range(period):
        current = [have + want for have, want in zip(current, quota)]
        chosen = max(range(len(quota)), key=lambda c: current[c])
        current[chosen] -= period
        order[slot] = chosen
    return order


class BlendSplit:
    """Samples of several splits (plait.train.data.corpus: Split or DocumentSplit) in fixed shares,
    by global sample number (see the module docstring). `ordered`: the sampler deals sample
    numbers in order; the permutations are inside each corpus (`shuffle`, for training)."""

    ordered = True

    def __init__(self, parts: list[Any], weights: list[float], seed: int, shuffle: bool):
        self.parts, self.seed, self.shuffle = parts, seed, shuffle
        self.quota = np.asarray(quotas(weights), dtype=np.int64)
        self.order = slot_order(list(self.quota))
        onehot = np.zeros((len(self.order), len(parts)), dtype=np.int64)
        onehot[np.arange(len(self.order)), self.order] = 1
        self.earlier = np.cumsum(onehot, axis=0) - onehot  # samples each corpus gave before each slot
        self._permutations: dict[int, tuple[int, torch.Tensor]] = {}
        self.seq_len = parts[0].seq_len

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def locate(self, n: int) -> tuple[int, int]:
        """(corpus, how many of its samples came before) of global sample `n`."""
        rounds, slot = divmod(n, len(self.order))
        corpus = int(self.order[slot])
        return corpus, rounds * int(self.quota[corpus]) + int(self.earlier[slot, corpus])

    def counts(self, samples: int) -> list[int]:
        """How many of the first `samples` samples each corpus gave."""
        rounds, slot = divmod(samples, len(self.order))
        return [int(rounds * q + e) for q, e in zip(self.quota, self.earlier[slot])]

    @property
    def num_samples(self) -> int:
        """Held out: the samples before any corpus would repeat one; training: no end (each
        corpus runs through its own epochs)."""
        if self.shuffle:
            return 1 << 60
        sizes = [part.num_samples for part in self.parts]
        low, high = 0, sum(sizes) + 1
        while high - low > 1:  # the most samples whose every corpus's count stays within its size
            middle = (low + high) // 2
            low, high = (middle, high) if all(c <= s for c, s in zip(self.counts(middle), sizes)) else (low, middle)
        return low

    def _sample(self, corpus: int, k: int) -> int:
        part = self.parts[corpus]
        if not self.shuffle:
            return k
        epoch, within = divmod(k, part.num_samples)
        held = self._permutations.get(corpus)
        if held is None or held[0] != epoch:
            held = (epoch, epoch_permutation(part.num_samples, self.seed + 7919 * (corpus + 1), epoch))
            self._permutations[corpus] = held
        return int(held[1][within])

    def batch(self, indices: list[int]) -> tuple[Any, torch.Tensor]:
        """Inputs and next-token targets of global samples `indices`, each (len, seq_len)."""
        rows = []
        for n in indices:
            corpus, k = self.locate(n)
            rows.append(self.parts[corpus].batch([self._sample(corpus, k)]))
        return stack_rows(rows)

    @property
    def per_token(self) -> bool:
        return any(getattr(part, "per_token", False) for part in self.parts)

    @property
    def doc_mask(self) -> bool:
        return any(getattr(part, "doc_mask", False) for part in self.parts)

    def realised(self, samples: int) -> list[float]:
        """Each corpus's share of the first `samples` samples."""
        counts = self.counts(samples)
        return [c / max(1, samples) for c in counts]


def language_splits(data: str, seq_len: int, seed: int, packing: str = "auto",
                    doc_mask: str = "auto") -> tuple[Any, Any, int]:
    """A language task's (training split, held-out split, corpus fingerprint) of `--data`: one
    corpus (plait.train.data.corpus: train_val_split), or a blend of several (`load_blend`),
    its documents packed as `--packing` and `--doc-mask` say (plait.train.data.packing)."""
    parts = blend_parts(data)
    if parts:
        return load_blend(parts, seq_len, seed, packing, doc_mask)
    tokens = load_corpus(data)
    return (*train_val_split(tokens, seq_len, seed=seed, packing=packing_for(tokens, packing, doc_mask)),
            corpus_digest(tokens))


def load_blend(parts: list[BlendPart], seq_len: int, seed: int, packing: str = "auto",
               doc_mask: str = "auto") -> tuple[BlendSplit, BlendSplit, int]:
    """Training and held-out blends of `parts`, and a fingerprint of the corpora and their shares."""
    trains, vals, digest, kinds = [], [], hashlib.sha256(), set()
    for part in parts:
        tokens = load_corpus(part.source)
        packed = packing_for(tokens, packing, doc_mask)
        kinds.add(packed)
        if len(kinds) > 1:
            raise PlaitError(f"--data blends corpora packed differently ({' and '.join(sorted(map(str, kinds)))}): a "
                             "batch's sequences must all be one kind", hint="give --packing and --doc-mask explicitly")
        train, val = train_val_split(tokens, seq_len, seed=seed, packing=packed)
        if train.num_samples == 0:
            raise PlaitError(f"--data blends {part.source}, which gives no training sequence of {seq_len} tokens",
                             hint="lower --seq-len, or give that corpus more text")
        trains.append(train)
        vals.append(val)
        digest.update(f"{corpus_digest(tokens)}:{part.weight!r};".encode())
    weights = [p.weight for p in parts]
    fingerprint = int.from_bytes(digest.digest()[:8], "little") >> 2
    return BlendSplit(trains, weights, seed, shuffle=True), BlendSplit(vals, weights, seed, shuffle=False), fingerprint
