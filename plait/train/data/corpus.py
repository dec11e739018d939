"""Data: a byte-level corpus that needs no download, and a sampler that is layout-free.

The default corpus, `embedded`, ships inside plait (plait/train/data/corpus.txt.gz, 1.3 MB of
text): plait's own documentation and Python source as of one commit, frozen, so that a seed
trains the same model on every machine. (It was made once with `git ls-files 'docs/*.md'
'plait/*.py' | LC_ALL=C sort | xargs cat | gzip -9n`; the files have moved on since, the
corpus has not.) `stdlib`, the running interpreter's standard library (its first 8 MiB of
.py files), is larger but differs between Python versions, so a curve trained on it differs
too. Tokens are bytes (vocabulary 256), so no tokenizer has to be trained or fetched. Raw
text given with `--data` is read whole, up to 8 MiB (larger is refused, never cut). A corpus of any size is tokenized once by `plait data prepare` and mapped by
every rank (plait/train/data/tokens.py), with any tokenizer.

Sampling is what makes parity testable. Each epoch is one permutation of the samples, fixed
by (seed, epoch). Global step s takes permutation entries [s·G, (s+1)·G) with G the global
batch, and dp rank r takes the r-th contiguous G/dp of them. Together the ranks of step s
therefore hold exactly the same G samples for any dp degree, accumulation or micro-batch
size (even cut into micro-batches the same way, when micro-batch × dp stays fixed), and a
run can resume from (epoch, position) alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.errors import PlaitError
from plait.parallel.packed import Packed
from plait.train.data.tokens import (DOCUMENTS, EMBEDDED, LOSS_MASK, RAW_LIMIT, TOKENS, builtin_files, check_tokens,
                                     is_prepared, open_corpus_file, raw_files)

def load_corpus(source: str = EMBEDDED, max_bytes: int = RAW_LIMIT) -> torch.Tensor:
    """The corpus as a tensor of token ids: `source` is "embedded" or "stdlib" (its first
    `max_bytes`), a text file or directory (at most `max_bytes`, else an error), or a
    prepared directory."""
    if is_prepared(source):
        return map_tokens(source)
    files: Iterable[Path] | None = builtin_files(source)
    if files is None:
        files = raw_files(source, max_bytes)
    chunks, total = [], 0
    for path in files:
        with open_corpus_file(path) as handle:
            data = handle.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise PlaitError(f"corpus {source!r} is empty", hint="point --data at files with text in them")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def map_tokens(directory: str) -> torch.Tensor:
    """A prepared corpus's token file, mapped (not read): pages load as batches touch them.

    Its sha256 rides along as `plait_digest`, so that comparing corpora across ranks reads
    the index, not every token; a corpus of records carries its documents' ends as
    `plait_documents` (documents.bin, mapped too)."""
    index = check_tokens(directory)
    dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[index.dtype]
    tokens = torch.from_file(str(Path(directory) / TOKENS), shared=False, size=index.count, dtype=dtype)
    tokens.plait_digest = int.from_bytes(bytes.fromhex(index.sha256)[:8], "little") >> 2
    if index.documents:
        tokens.plait_documents = document_ends(Path(directory), index)
        tokens.plait_eos = index.eos
        tokens.plait_format = index.data_format
    if index.loss_mask:
        tokens.plait_loss_mask = loss_mask(Path(directory), index)
    return tokens


def loss_mask(directory: Path, index: Any) -> torch.Tensor:
    """Which tokens carry the loss (loss_mask.bin, one byte each, mapped), checked for its size."""
    path = directory / LOSS_MASK
    if not path.is_file() or path.stat().st_size != index.count:
        raise PlaitError(f"{path} is missing or not one byte for each of the {index.count:,} tokens",
                         hint=f"prepare the corpus again with `plait data prepare ... --out {directory}`")
    return torch.from_file(str(path), shared=False, size=index.count, dtype=torch.uint8)


def document_ends(directory: Path, index: Any) -> np.ndarray:
    """Each document's end in the token file, checked against the index (count, order, last end)."""
    path = directory / DOCUMENTS
    if not path.is_file() or path.stat().st_size != 8 * index.documents:
        raise PlaitError(f"{path} is missing or not {index.documents:,} document ends",
                         hint=f"prepare the corpus again with `plait data prepare ... --out {directory}`")
    ends = np.memmap(path, dtype="<u8", mode="r")
    if int(ends[-1]) != index.count or bool((np.diff(ends.astype(np.int64)) <= 0).any()):
        raise PlaitError(f"{path} does not end each document after the last (its ends are not increasing to "
                         f"{index.count:,})", hint=f"prepare the corpus again with `plait data prepare ... --out "
                                                  f"{directory}`")
    return ends


def corpus_digest(tokens: torch.Tensor) -> int:
    """A 62-bit fingerprint, compared across ranks to catch nodes with different corpora."""
    if hasattr(tokens, "plait_digest"):  # a mapped corpus: its index's checksum
        return tokens.plait_digest
    return int.from_bytes(hashlib.sha256(tokens.numpy().tobytes()).digest()[:8], "little") >> 2


@dataclass(frozen=True)
class Split:
    """Fixed-length windows over a token stream: sample i is tokens[i·seq : i·seq + seq + 1]."""

    tokens: torch.Tensor
    seq_len: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_samples(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(indices), seq_len), as int64 (the inputs
        their own: `own_inputs`)."""
        rows = torch.stack([self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
                            for i in indices]).long()
        return own_inputs(rows), rows[:, 1:]


def own_inputs(rows: torch.Tensor) -> torch.Tensor:
    """The inputs of (batch, seq + 1) windows in storage of their own, not a view beside the
    targets: the embedding keeps its ids for backward, and a view would keep the whole windows,
    8·b bytes more than the b·s ids plait estimate counts (plait.estimate.activations)."""
    return rows[:, :-1].contiguous()


class DocumentSplit:
    """Fixed-length windows over some documents of a corpus, as if they were one stream:
    sample i is the stream's tokens [i·seq, i·seq + seq + 1), read from each document run it
    crosses (`runs`: (start, end) in the token file, consecutive documents merged).

    `--packing concat` (plait.train.data.packing): with `doc_mask`, positions restart at each
    document (`document_starts`: each one's first token in the stream) and attention stays
    inside it; `carries` (the corpus's loss mask) makes the prompts' targets IGNORE."""

    def __init__(self, tokens: torch.Tensor, runs: np.ndarray, seq_len: int, *,
                 document_starts: np.ndarray | None = None, doc_mask: bool = False,
                 carries: torch.Tensor | None = None):
        self.corpus, self.seq_len = tokens, seq_len
        self.starts = runs[:, 0].astype(np.int64)
        self.ends = np.cumsum(runs[:, 1] - runs[:, 0]).astype(np.int64)  # each run's end in the stream
        self.document_starts, self.doc_mask, self.carries = document_starts, doc_mask, carries
        self.per_token = doc_mask or carries is not None

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def num_samples(self) -> int:
        return max(0, (len(self) - 1) // self.seq_len)

    def window(self, lo: int, hi: int, source: torch.Tensor | None = None) -> torch.Tensor:
        """The stream's tokens [lo, hi) (or the same stretch of `source`, one value per token)."""
        source = self.corpus if source is None else source
        k, pieces = int(np.searchsorted(self.ends, lo, side="right")), []
        while lo < hi:
            begin = int(self.ends[k - 1]) if k else 0
            take = min(hi, int(self.ends[k])) - lo
            at = int(self.starts[k]) + lo - begin
            pieces.append(source[at:at + take])
            lo, k = lo + take, k + 1
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def batch(self, indices: list[int]) -> tuple[Any, torch.Tensor]:
        """Inputs and next-token targets, each (len(indices), seq_len), as int64; under
        `doc_mask` the inputs are packed documents (plait.parallel.packed.Packed)."""
        from plait.train.data.packing import masked_targets, window_positions

        spans = [(i * self.seq_len, i * self.seq_len + self.seq_len + 1) for i in indices]
        rows = torch.stack([self.window(lo, hi) for lo, hi in spans]).long()
        inputs, targets = own_inputs(rows), rows[:, 1:]
        if not self.per_token:
            return inputs, targets
        carries = None
        if self.carries is not None:
            carries = torch.stack([self.window(lo + 1, hi, self.carries) for lo, hi in spans]).bool()
        if not self.doc_mask:
            return inputs, masked_targets(targets, carries, None)
        assert self.document_starts is not None
        where = [window_positions(self.document_starts, lo, self.seq_len) for lo, _ in spans]
        positions = torch.from_numpy(np.stack([w[0] for w in where]))
        ends = torch.from_numpy(np.stack([w[1] for w in where]))
        return Packed.of(inputs, positions), masked_targets(targets, carries, ends)


def held_out_documents(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which of `count` documents are held out: those whose hash of (seed, index) falls under
    `fraction`, so the choice is the same on every rank and every run with this seed, and
    never depends on where a document sits in the stream; at least one either side."""
    with np.errstate(over="ignore"):  # splitmix64: wrapping arithmetic is the point
        x = np.arange(count, dtype=np.uint64) + np.uint64(seed % 2**64) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    score = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    held = score < fraction
    if count >= 2 and not held.any():
        held[int(score.argmin())] = True
    if count >= 2 and held.all():
        held[int(score.argmax())] = False
    return held


def document_runs(ends: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """(start, end) in the token file of each run of consecutive chosen documents."""
    starts = np.concatenate([[0], ends[:-1].astype(np.int64)])
    edges = np.diff(np.concatenate([[0], chosen.astype(np.int8), [0]]))
    first, last = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    return np.stack([starts[first], ends[last].astype(np.int64)], axis=1) if len(first) else np.zeros((0, 2), np.int64)


def train_val_split(tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05,
                    seed: int = 0, packing: Any = None) -> tuple[Any, Any]:
    """Held out for evaluation: whole documents of a corpus of records (`held_out_documents`,
    stable under `seed`), else the last `val_fraction` of the stream. `packing`
    (plait.train.data.packing.Packing; default concat without masks) says how documents
    become sequences."""
    ends = getattr(tokens, "plait_documents", None)
    if ends is None:
        if packing is not None and packing.per_token:
            raise PlaitError("this corpus is one stream of text, without the document boundaries that "
                             "--packing best-fit and --doc-mask need", hint="prepare records with `plait data prepare`")
        cut = int(len(tokens) * (1 - val_fraction))
        return Split(tokens[:cut], seq_len), Split(tokens[cut:], seq_len)
    held = held_out_documents(len(ends), val_fraction, seed)
    return tuple(document_split(tokens, ends, chosen, seq_len, packing) for chosen in (~held, held))  # type: ignore


def document_split(tokens: torch.Tensor, ends: np.ndarray, chosen: np.ndarray, seq_len: int, packing: Any) -> Any:
    """The `chosen` documents of a corpus of records as sequences, by `packing`."""
    from plait.train.data.packing import BestFitSplit

    carries = getattr(tokens, "plait_loss_mask", None)
    bounds = np.concatenate([[0], ends.astype(np.int64)])
    starts, lengths = bounds[:-1][chosen], np.diff(bounds)[chosen]
    if packing is not None and packing.kind == "best-fit":
        pad = int(getattr(tokens, "plait_eos", None) or 0)
        return BestFitSplit(tokens, starts, lengths, seq_len, packing.doc_mask, carries, pad)
    doc_mask = packing is not None and packing.doc_mask
    stream_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if doc_mask else None
    return DocumentSplit(tokens, document_runs(ends, chosen), seq_len, document_starts=stream_starts,
                         doc_mask=doc_mask, carries=carries)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def shard_indices(n: int, mesh: object, seed: int, epoch: int, block: int = 1) -> list[int]:
    """This dp rank's samples of epoch `epoch`, in the order it should consume them.

    The epoch's permutation is dealt out to the dp ranks `block` samples at a time: rank r
    gets blocks r, r + dp, r + 2·dp, ... With block = 1 this is the classic strided sampler.
    The trainer uses block = micro-batch × grad-accum, so the G = block × dp samples of a
    step are one contiguous run of the permutation, and rank r's part of it is exactly what
    micro-batches r·accum ... of a one-process run with accumulation would hold.

    `mesh` is a plait Mesh or a (dp_rank, dp_size) pair. The tail that does not fill a whole
    round of blocks is dropped, so every rank gets the same count.
    """
    rank, size = (mesh.rank("dp"), mesh.size("dp")) if hasattr(mesh, "rank") else mesh
    perm = epoch_permutation(n, seed, epoch)
    rounds = n // (block * size)
    dealt = perm[: rounds * block * size].view(rounds, size, block)
    return dealt[:, rank, :].flatten().tolist()


@dataclass(frozen=True)
class StepSampler:
    """Which samples each micro-batch of each step holds, on one dp rank. `ordered`: the split
    shuffles within itself (a blend), so step s simply takes samples [s·G, (s+1)·G)."""

    num_samples: int
    global_batch: int
    dp_rank: int
    dp_size: int
    micro_batch: int
    seed: int
    ordered: bool = False

    def __post_init__(self) -> None:
        if self.global_batch % (self.dp_size * self.micro_batch):
            raise PlaitError(f"global batch {self.global_batch} is not divisible by dp × micro-batch")
        if self.steps_per_epoch == 0:
            raise PlaitError(
                f"the corpus gives {self.num_samples} samples, fewer than the global batch of {self.global_batch}",
                hint="lower --seq-len, --micro-batch or --grad-accum, or give a larger --data",
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of global step `step`: all a resume needs."""
        return divmod(step, self.steps_per_epoch)

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's sample indices for `step`, cut into micro-batches."""
        epoch, pos = self.position(step)
        local = self.global_batch // self.dp_size
        if self.ordered:
            start = (step * self.dp_size + self.dp_rank) * local
            return [list(range(start + i, start + min(i + self.micro_batch, local))) for i in range(0, local,
                                                                                                   self.micro_batch)]
        # shard_indices(..., block=local)[pos·local : (pos+1)·local], read straight from the
        # permutation: a large corpus's epoch is never turned into a Python list per step.
        start = (pos * self.dp_size + self.dp_rank) * local
        chunk = epoch_permutation(self.num_samples, self.seed, epoch)[start: start + local].tolist()
        return [chunk[i: i + self.micro_batch] for i in range(0, local, self.micro_batch)]
