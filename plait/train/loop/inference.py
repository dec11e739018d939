"""Evaluation and the closing sample, for any task and any layout.

Both must run on every rank alike: under tensor parallelism or ZeRO-3 a forward is
collective, and a pipeline's forward crosses its stages; the executor
(plait.parallel.executor) runs those forwards. What is evaluated and how it is scored is the
task's (plait.train.loop.task); this module only deals the held-out samples out and adds up what
the task reports per sample: the task names how many held-out samples it scores (the same
for every layout); dp rank r takes samples r, r + dp, ...; every rank runs the same number
of micro-batches of the same shape (a pipeline agrees on shapes once), the short ones
padded with sample 0 whose rows are left out of the sums; the sums are added over dp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from plait.errors import PlaitError
from plait.parallel.compiled import eager
from plait.parallel.executor import Executor
from plait.parallel.packed import IGNORE, Packed
from plait.parallel.probe_views import dtype_of, relative_error, tolerance
from plait.runtime import comm
from plait.runtime.mesh import Mesh


class Inference:
    """The trained model called forward only, for any task and any layout."""

    def __init__(self, executor: Executor, mesh: Mesh, task: Any, loss_fn: Any, micro_batch: int):
        self.executor, self.model, self.mesh, self.task = executor, executor.model, mesh, task
        self.loss_fn, self.micro_batch = loss_fn, micro_batch

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    @eager()
    def evaluate(self, split: Any) -> dict[str, float]:
        """The task's metrics over its held-out samples (eval mode: running statistics)."""
        return self.task.eval_metrics(self.totals(split))

    @torch.no_grad()
    @eager()
    def totals(self, split: Any) -> dict[str, float]:
        """The task's `eval_columns` summed over its held-out samples, on every rank."""
        batches = self._eval_batches(split)
        with self._eval_mode():
            rows = self._rows(batches)
        real = torch.tensor([[r < n for r in range(self.micro_batch)] for n, _, _ in batches],
                            dtype=torch.float64, device=self.mesh.device)
        totals = (rows * real.unsqueeze(-1)).sum(dim=(0, 1))
        comm.all_reduce(totals, self.mesh.axis("dp"), purpose=comm.TELEMETRY)
        return dict(zip(self.task.eval_columns, totals.tolist()))

    @torch.no_grad()
    @eager()
    def check_documents(self, seq_len: int, vocab: int) -> float:
        """--doc-mask's promise, held to the model as it is split, before it trains: three
        documents packed in one sequence score every token as each document does alone at the
        start of a sequence. A model that carries state along its sequence whatever the
        positions say (linear attention), or that ignores position ids, fails it and is
        refused in one line rather than train on documents that see each other. Returns the
        relative difference found (collective: every rank runs the same four rows)."""
        quarter = max(1, seq_len // 4)
        lengths = [seq_len - 2 * quarter, quarter, quarter]
        starts = [0, lengths[0], lengths[0] + lengths[1]]
        ids = torch.randint(0, vocab, (seq_len,), generator=torch.Generator().manual_seed(0))
        positions = torch.cat([torch.arange(n) for n in lengths])
        packed_targets = torch.full((seq_len,), IGNORE, dtype=torch.long)
        batches: list[tuple[Any, torch.Tensor]] = []
        for start, n in zip(starts, lengths):
            packed_targets[start:start + n - 1] = ids[start + 1:start + n]
            alone = torch.cat([ids[start:start + n], ids[:seq_len - n]])  # the document first, anything after
            targets = torch.full((seq_len,), IGNORE, dtype=torch.long)
            targets[:n - 1] = ids[start + 1:start + n]
            batches.append((alone[None], targets[None]))
        batches.insert(0, (Packed.of(ids[None], positions[None]), packed_targets[None]))
        batches = [(x.to(self.mesh.device), t.to(self.mesh.device)) for x, t in batches]

        def losses(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(outputs, targets, reduction="none").view(targets.shape[0], -1).double()

        with self._eval_mode():
            rows = self.executor.eval_rows(batches, losses, seq_len)[:, 0].cpu()
        packed = torch.cat([rows[0, start:start + n - 1] for start, n in zip(starts, lengths)])
        alone = torch.cat([rows[1 + k, :n - 1] for k, n in enumerate(lengths)])
        error = relative_error(packed, alone)
        if error > tolerance(dtype_of(self.model)):
            raise PlaitError(f"--doc-mask: --model {self.task.config.model} does not keep packed documents apart: on a probe "
                             f"of 3 documents in one sequence, a document's loss differs from its run alone by "
                             f"{error:.1e} (relative), as a model that carries state along its sequence (linear "
                             "attention) or ignores position ids does",
                             hint="train it with --doc-mask false (its documents then see each other, as with "
                                  "--packing concat), or train another model")
        return error

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Eval mode (no dropout, BatchNorm's running statistics) for what runs inside, then training's."""
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def _eval_batches(self, split: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(real samples, inputs, targets) of this rank's micro-batches, padded alike on all ranks."""
        count, dp = self.task.eval_count(split), self.mesh.size("dp")
        mine = list(range(self.mesh.rank("dp"), count, dp))
        micro, per_rank = self.micro_batch, -(-count // dp)
        batches = -(-per_rank // micro)
        out = []
        for b in range(batches):
            indices = mine[b * micro:(b + 1) * micro]
            inputs, targets = self.task.batch(split, indices + [0] * (micro - len(indices)), 0)
            out.append((len(indices), inputs.to(self.mesh.device), targets.to(self.mesh.device)))
        return out

    def _rows(self, batches: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(batches, micro-batch, columns): the task's per-sample sums of every micro-batch."""

        def rows(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return self.task.eval_sums(outputs, targets, self.loss_fn).double()

        return self.executor.eval_rows([(x, t) for _, x, t in batches], rows, len(self.task.eval_columns))

    def next_logits(self, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Whole-vocabulary logits after the last position of `ids`, on every rank (collective)."""
        return self.executor.next_logits(ids, vocab_size)
