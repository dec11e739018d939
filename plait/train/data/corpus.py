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

import torch

from plait.errors import PlaitError
from plait.train.data.tokens import (EMBEDDED, RAW_LIMIT, TOKENS, builtin_files, check_tokens, is_prepared,
                               open_corpus_file, raw_files)

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
    the index, not every token."""
    index = check_tokens(directory)
    dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[index.dtype]
    tokens = torch.from_file(str(Path(directory) / TOKENS), shared=False, size=index.count, dtype=dtype)
    tokens.plait_digest = int.from_bytes(bytes.fromhex(index.sha256)[:8], "little") >> 2
    return tokens


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

    @property
    def num_samples(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(indices), seq_len), as int64."""
        rows = torch.stack([self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
                            for i in indices]).long()
        return rows[:, :-1], rows[:, 1:]


def train_val_split(tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05) -> tuple[Split, Split]:
    """The last `val_fraction` of the corpus is held out for evaluation."""
    cut = int(len(tokens) * (1 - val_fraction))
    return Split(tokens[:cut], seq_len), Split(tokens[cut:], seq_len)


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
    """Which samples each micro-batch of each step holds, on one dp rank."""

    num_samples: int
    global_batch: int
    dp_rank: int
    dp_size: int
    micro_batch: int
    seed: int

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
        # shard_indices(..., block=local)[pos·local : (pos+1)·local], read straight from the
        # permutation: a large corpus's epoch is never turned into a Python list per step.
        start = (pos * self.dp_size + self.dp_rank) * local
        chunk = epoch_permutation(self.num_samples, self.seed, epoch)[start: start + local].tolist()
        return [chunk[i: i + self.micro_batch] for i in range(0, local, self.micro_batch)]
