"""How documents become training sequences: `--packing concat|best-fit` and `--doc-mask`.

A corpus of records (plait data prepare) keeps where each document ends (documents.bin) and,
for completion and chat data, which tokens carry the loss (loss_mask.bin). Two packings:

- **concat**: fixed windows over the documents as one stream, each followed by its EOS
  (today's behaviour, so existing curves stay). A document may be cut by a window's edge.
- **best-fit**: whole documents placed into sequences by best-fit decreasing, the longest
  first into the fullest sequence it fits; a sequence's free tail is padding that carries no
  loss. A document is never cut unless it is longer than a sequence, and then only into
  sequence-long pieces (Ding et al., 2024: packing without truncation).

`--doc-mask` keeps attention inside each document and restarts positions at each (the batch's
inputs are then plait.parallel.packed.Packed); the token after a document's end is another
document's first, so the target there carries no loss. Defaults: best-fit with masks for
completion and chat data, concat without for text. Both are pure functions of the corpus, the
held-out choice and the sequence length: the same on every rank, for every layout.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from plait.errors import PlaitError
from plait.parallel.packed import IGNORE, Packed
from plait.rules import PACKINGS
from plait.train.data.tokens import FINE_TUNING_FORMATS

CHUNK_DOCUMENTS = 1 << 16  # best-fit packs this many documents at a time: bounded work, corpus order kept


@dataclass(frozen=True)
class Packing:
    """What `--packing` and `--doc-mask` resolved to for a corpus."""

    kind: str = "concat"  # concat | best-fit
    doc_mask: bool = False

    @property
    def per_token(self) -> bool:
        """Whether some targets carry no loss, so the loss is normalised by the step's count."""
        return self.kind == "best-fit" or self.doc_mask


def resolve_packing(packing: str, doc_mask: str, documents: bool, fine_tuning: bool) -> Packing:
    """`--packing` and `--doc-mask` ("auto" or a value) for a corpus with (or without) document
    boundaries and loss masks: one line refusing what the corpus cannot give."""
    kind = packing if packing != "auto" else ("best-fit" if fine_tuning else "concat")
    masked = {"auto": fine_tuning, "true": True, "false": False}[doc_mask]
    if kind not in PACKINGS:
        raise PlaitError(f"--packing {packing!r} is not one of: auto, {', '.join(PACKINGS)}", hint="e.g. --packing concat")
    if not documents and (kind == "best-fit" or masked):
        asked = "--packing best-fit" if kind == "best-fit" else "--doc-mask true"
        raise PlaitError(f"{asked} needs the corpus's document boundaries, and this corpus is one stream of text",
                         hint="prepare records (jsonl, parquet...) with `plait data prepare`, or drop " + asked)
    return Packing(kind, masked)


def packing_for(tokens: Any, packing: str = "auto", doc_mask: str = "auto") -> Packing:
    """`--packing` and `--doc-mask` resolved for a loaded corpus (plait.train.data.corpus)."""
    documents = getattr(tokens, "plait_documents", None) is not None
    fine_tuning = getattr(tokens, "plait_format", "text") in FINE_TUNING_FORMATS
    return resolve_packing(packing, doc_mask, documents, fine_tuning)


def window_positions(starts: np.ndarray, lo: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the stream's tokens [lo, lo + length) within their documents (restarting
    at each document, and at the window's start), and whether each token ends its document
    (`starts`: each document's first token in the stream, ascending, starting with 0)."""
    at = np.arange(lo, lo + length, dtype=np.int64)
    begin = starts[np.searchsorted(starts, at, side="right") - 1]
    ends = np.isin(at + 1, starts)
    return at - np.maximum(begin, lo), ends


def masked_targets(targets: torch.Tensor, carries: torch.Tensor | None, ends: torch.Tensor | None) -> torch.Tensor:
    """`targets` with IGNORE where the target token carries no loss (`carries` false) or where
    the input token ends its document (`ends`: the next token is another document's)."""
    out = targets.clone()
    if carries is not None:
        out[~carries] = IGNORE
    if ends is not None:
        out[ends] = IGNORE
    return out


def stack_rows(rows: list[tuple[Any, torch.Tensor]]) -> tuple[Any, torch.Tensor]:
    """One batch from single-row batches of one kind (plain ids or packed documents)."""
    inputs = [r[0] for r in rows]
    targets = torch.cat([r[1] for r in rows])
    if isinstance(inputs[0], Packed):
        return Packed.of(torch.cat([p.ids for p in inputs]), torch.cat([p.positions for p in inputs])), targets
    return torch.cat(inputs), targets


def pieces_of(starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents (start in the token file, length) cut into pieces of at most `seq_len`
    tokens: a document that fits is one piece, whole."""
    count = -(-lengths // seq_len)
    first = np.repeat(starts, count)
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    piece_starts = first + within * seq_len
    piece_lengths = np.minimum(seq_len, np.repeat(starts + lengths, count) - piece_starts)
    return piece_starts, piece_lengths


def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each piece (longest first; ties in corpus order) into the bin with
    the least room that still holds it, else a new bin; pieces packed CHUNK_DOCUMENTS at a time.
    Returns each bin's piece indices."""
    bins: list[list[int]] = []
    for lo in range(0, len(lengths), CHUNK_DOCUMENTS):
        chunk = np.arange(lo, min(lo + CHUNK_DOCUMENTS, len(lengths)))
        order = chunk[np.argsort(-lengths[chunk], kind="stable")]
        rooms: list[tuple[int, int]] = []  # (room left, bin), ascending
        first = len(bins)
        for piece in order.tolist():
            need = int(lengths[piece])
            k = bisect.bisect_left(rooms, (need, -1))
            if k < len(rooms):
                room, b = rooms.pop(k)
            else:
                room, b = capacity, len(bins)
                bins.append([])
            bins[b].append(piece)
            if room - need > 0:
                bisect.insort(rooms, (room - need, b))
        for b in range(first, len(bins)):
            bins[b].sort()  # corpus order inside a sequence
    return bins


class BestFitSplit:
    """Sequences of whole documents (`best_fit`), padded: sample i is bin i.

    `starts`, `lengths`: the split's documents in the token file; `carries`: the corpus's loss
    mask (uint8 per token) or None; `pad`: the id a free tail holds (it carries no loss)."""

    def __init__(self, tokens: torch.Tensor, starts: np.ndarray, lengths: np.ndarray, seq_len: int,
                 doc_mask: bool, carries: torch.Tensor | None, pad: int):
        self.corpus, self.seq_len, self.doc_mask, self.carries, self.pad = tokens, seq_len, doc_mask, carries, pad
        self.piece_starts, self.piece_lengths = pieces_of(starts.astype(np.int64), lengths.astype(np.int64), seq_len)
        bins = best_fit(self.piece_lengths, seq_len)
        self.bin_offsets = np.cumsum([0] + [len(b) for b in bins]).astype(np.int64)
        self.bin_pieces = np.asarray([p for b in bins for p in b], dtype=np.int64)
        self.documents = len(starts)
        self.tokens = int(lengths.sum())
        self.per_token = True

    def __len__(self) -> int:
        return self.tokens

    @property
    def num_samples(self) -> int:
        return len(self.bin_offsets) - 1

    def documents_in(self, samples: int) -> int:
        """How many pieces the first `samples` sequences hold (documents, for those that fit)."""
        return int(self.bin_offsets[min(samples, self.num_samples)])

    def _row(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, carries the loss, ends its piece) of sequence i, each (seq_len,)."""
        pieces = self.bin_pieces[self.bin_offsets[i]:self.bin_offsets[i + 1]]
        ids, positions, carries, ends = [], [], [], []
        for p in pieces.tolist():
            start, n = int(self.piece_starts[p]), int(self.piece_lengths[p])
            ids.append(self.corpus[start:start + n].long())
            positions.append(torch.arange(n))
            carries.append(self.carries[start:start + n].bool() if self.carries is not None
                           else torch.ones(n, dtype=torch.bool))
            end = torch.zeros(n, dtype=torch.bool)
            end[-1] = True
            ends.append(end)
        free = self.seq_len - sum(len(x) for x in ids)
        if free:
            ids.append(torch.full((free,), self.pad, dtype=torch.long))
            positions.append(torch.arange(free))
            carries.append(torch.zeros(free, dtype=torch.bool))
            ends.append(torch.ones(free, dtype=torch.bool))
        return torch.cat(ids), torch.cat(positions), torch.cat(carries), torch.cat(ends)

    def batch(self, indices: list[int]) -> tuple[Any, torch.Tensor]:
        """Inputs (packed documents under --doc-mask, else ids) and targets, each (len, seq_len):
        a target is IGNORE at each piece's last token, in the padding, and off the loss mask."""
        rows = [self._row(i) for i in indices]
        ids = torch.stack([r[0] for r in rows])
        targets = torch.cat([ids[:, 1:], torch.full((len(rows), 1), IGNORE, dtype=torch.long)], dim=1)
        carries = torch.stack([torch.cat([r[2][1:], torch.zeros(1, dtype=torch.bool)]) for r in rows])
        targets = masked_targets(targets, carries, torch.stack([r[3] for r in rows]))
        if not self.doc_mask:
            return ids, targets
        return Packed.of(ids, torch.stack([r[1] for r in rows])), targets
