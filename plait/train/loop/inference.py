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

from typing import Any

import torch

from plait.parallel.compiled import eager
from plait.parallel.executor import Executor
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
        self.model.eval()
        try:
            rows = self._rows(batches)
        finally:
            self.model.train()
        real = torch.tensor([[r < n for r in range(self.micro_batch)] for n, _, _ in batches],
                            dtype=torch.float64, device=self.mesh.device)
        totals = (rows * real.unsqueeze(-1)).sum(dim=(0, 1))
        comm.all_reduce(totals, self.mesh.axis("dp"), purpose=comm.TELEMETRY)
        return dict(zip(self.task.eval_columns, totals.tolist()))

    def _eval_batches(self, split: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(real samples, inputs, targets) of this rank's micro-batches, padded alike on all ranks."""
        count, dp = self.task.eval_count(split), self.mesh.size("dp")
        mine = list(range(self.mesh.rank("dp"), count, dp))
        micro, per_rank = self.micro_batch, -(-count // dp)
        batches = -(-per_rank // micro)
        batches += -batches % self.executor.eval_multiple
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
