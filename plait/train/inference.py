"""Forward passes without a backward, through any layout: evaluation, and the closing sample.

Both must run on every rank alike: under tensor parallelism or ZeRO-3 a forward is
collective, and a pipeline's forward crosses its stages. What is evaluated and how it is
scored is the task's (plait.train.task); this module only deals the held-out samples out
and adds up what the task reports per sample:

- the task names how many held-out samples it scores (the same for every layout); dp rank r
  takes samples r, r + dp, ...; every rank runs the same number of micro-batches of the
  same shape (a pipeline agrees on shapes once), the short ones padded with sample 0 whose
  rows are left out of the sums; the sums are added over dp;
- a language model's next-token logits at the end of a context, whole over the
  vocabulary, on every rank: padded to a multiple of tp under sequence parallelism (causal
  attention never lets a position see the padding after it), gathered over tp when the head
  keeps them split, sent from the last pipeline stage to the others.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.compiled import eager
from plait.parallel.pipeline.runner import PipelineRunner
from plait.parallel.tensor.loss import gather_vocab
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.runtime import comm
from plait.runtime.mesh import Mesh


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, or an object with `.logits` (transformers)."""
    return getattr(outputs, "logits", outputs)


class Inference:
    """The trained model called forward only, for any task and any layout."""

    def __init__(self, model: nn.Module, runner: PipelineRunner | None, mesh: Mesh, task: Any, loss_fn: Any,
                 micro_batch: int):
        self.model, self.runner, self.mesh, self.task = model, runner, mesh, task
        self.loss_fn, self.micro_batch = loss_fn, micro_batch

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    @eager()
    def evaluate(self, split: Any) -> dict[str, float]:
        """The task's metrics over its held-out samples (eval mode: running statistics)."""
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
        return self.task.eval_metrics(dict(zip(self.task.eval_columns, totals.tolist())))

    def _eval_batches(self, split: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(real samples, inputs, targets) of this rank's micro-batches, padded alike on all ranks."""
        count, dp = self.task.eval_count(split), self.mesh.size("dp")
        mine = list(range(self.mesh.rank("dp"), count, dp))
        micro, per_rank = self.micro_batch, -(-count // dp)
        batches = -(-per_rank // micro)
        if self.runner is not None:
            batches += -batches % self.runner.microbatch_multiple
        out = []
        for b in range(batches):
            indices = mine[b * micro:(b + 1) * micro]
            inputs, targets = self.task.batch(split, indices + [0] * (micro - len(indices)), 0)
            out.append((len(indices), inputs.to(self.mesh.device), targets.to(self.mesh.device)))
        return out

    def _rows(self, batches: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(batches, micro-batch, columns): the task's per-sample sums of every micro-batch."""
        width = len(self.task.eval_columns)

        def rows(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return self.task.eval_sums(outputs, targets, self.loss_fn).double()

        if self.runner is not None:
            return self.runner.eval_rows([x for _, x, _ in batches], [t for _, _, t in batches], rows, width)
        return torch.stack([rows(self.model(x), t) for _, x, t in batches]).to(self.mesh.device)

    # -- sampling --------------------------------------------------------------------------
    @torch.no_grad()
    @eager()
    def next_logits(self, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Whole-vocabulary logits after the last position of `ids` (batch, seq), on every rank."""
        info = tensor_parallel_of(self.model)
        multiple = info.axis.size if info is not None and info.sp else 1
        length = ids.shape[1]
        padded = F.pad(ids, (0, -length % multiple))
        self.model.eval()
        try:
            if self.runner is not None:
                logits = self.runner.last_logits(padded, position=length - 1)
            else:
                logits = logits_of(self.model(padded))[:, length - 1]
        finally:
            self.model.train()
        if logits is not None and info is not None and logits.shape[-1] != vocab_size:
            logits = gather_vocab(logits, info.axis)  # the head keeps them split by vocabulary
        if self.runner is None:
            return logits
        whole = logits.float() if logits is not None else torch.zeros((ids.shape[0], vocab_size),
                                                                       device=self.mesh.device)
        comm.broadcast(whole, self.mesh.axis("pp"), src=self.mesh.size("pp") - 1, purpose=comm.TELEMETRY)
        return whole
