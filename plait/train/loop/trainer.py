"""The training loop: read top to bottom, one optimizer step at a time.

Every rank runs this same code. `__init__` builds what a step needs: the task's model
from the seed, split by `parallelize` as the layout says, the optimizer, the step guard,
the data. Then each step is forward and backward over the micro-batches (the executor's:
the pipeline's schedule, or a plain loop that syncs gradients on the last micro-batch only,
with the hooks the strategies add), the step guard's all-ranks verdict and clipping, `optimizer.step()`, `zero_grad()`; between steps,
the line of metrics, a checkpoint when due, and one small all-reduce on which every rank
agrees whether to stop (a preemption signal, plait.train.checkpoint.preempt) and whether a background
save can be published. What a sample is, the loss and the metrics are the task's
(plait.train.loop.task); measurements go to the metrics component (plait.train.observe.metrics),
evaluation and sampling to plait.train.loop.inference, checkpoints to plait.train.checkpoint.write.
The loop imports no strategy: what `parallelize` applied runs through plait.parallel.executor.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from plait.api import parallelize
from plait.errors import EXIT_PREEMPTED, PlaitError, Preempted
from plait.parallel.compose import adamw_kernel, build_optimizer
from plait.parallel.deferred import CannotDefer, build_deferred
from plait.parallel.executor import Executor
from plait.parallel.materialize import Source
from plait.parallel.precision import StepGuard, param_dtype
from plait.bench.meter import ActivationMeter, model_state_bytes, peak_process_bytes
from plait.runtime import comm, console
from plait.runtime.inject import parse_bitflip
from plait.runtime.launch import RESTART_ENV
from plait.runtime.mesh import Mesh
from plait.train.checkpoint import read as checkpoint_read, write as checkpoint
from plait.train.config.settings import TrainConfig
from plait.train.data.corpus import StepSampler
from plait.train.loop.inference import Inference
from plait.train.loop.measure import MeasurePolicy
from plait.train.observe.metrics import Metrics
from plait.train.checkpoint.preempt import Preemption
from plait.train.checkpoint.restart import restart_count
from plait.train.loop.task import Task

T = TypeVar("T")
log = logging.getLogger(__name__)


def build_on_meta(task: Task, seed: int) -> tuple[torch.nn.Module, Source | None]:
    """The task's model on the meta device, and the source of its weights: the seed's draws
    replayed a tensor at a time (plait.parallel.deferred), or what the task's `weights` makes
    of them (a pretrained model's files). A task that says it cannot (`meta_build = False`),
    or a build that cannot be replayed, is built whole (source None), as before, and the log
    says why."""
    torch.manual_seed(seed)
    if getattr(task, "meta_build", True):
        try:
            model, deferred = build_deferred(lambda: task.build_model(seed))
            weights = getattr(task, "weights", None)
            return model, weights(model, deferred.draw_named) if callable(weights) else deferred.draw_named
        except CannotDefer as why:
            log.info("the model is built whole on every rank: %s", why.message)
            torch.manual_seed(seed)
    return task.build_model(seed), None


def build_parallel(task: Task, config: TrainConfig, mesh: Mesh) -> torch.nn.Module:
    """The task's model as this rank holds it under the run's layout (train's and eval's).

    Built on the meta device, split, and only then given values: each rank draws each tensor
    whole from the seed (or reads it from the task's weights), as one process would, and
    keeps its part, so the initial weights are the same whatever the layout. With pp > 1
    parallelize returns this rank's stages."""
    model, source = build_on_meta(task, config.seed)
    model = model.to(param_dtype(config.precision))  # fp32 masters: the optimizer's
    return parallelize(model, mesh, config.parallel_config(), adapter=task.adapter(model), source=source)


def explained(task: Task, run: Callable[[], T]) -> T:
    """`run()`, where a model that cannot run at all fails (its split's probe forward, the
    first step): the task may name the failure as the input's fault (`explain_failure`, e.g.
    a transformers model whose own forward fails at one process) in place of torch's raw
    exception; else it is raised as it came."""
    try:
        return run()
    except PlaitError:
        raise
    except Exception as exc:  # noqa: BLE001 - only explained, never hidden
        explain = getattr(task, "explain_failure", None)
        why = explain(exc) if explain is not None else None
        if why is None:
            raise
        raise why from exc


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr · min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Builds the model, optimizer and data for this rank, then trains."""

    def __init__(self, config: TrainConfig, mesh: Mesh, task: Task):
        mesh = mesh.with_layout(**config.layout.as_dict())  # the run's layout on the mesh's groups (same degrees)
        self.config, self.mesh, self.task = config, mesh, task
        self.start_bytes = peak_process_bytes(mesh.device)  # the process before the model: what the peak adds to
        self.model = explained(task, lambda: build_parallel(task, config, mesh))
        self.optimizer = build_optimizer(self.model, torch.optim.AdamW, lr=config.lr, betas=(0.9, 0.95),
                                         weight_decay=config.weight_decay,
                                         compiled_update=config.compiles_update,
                                         **adamw_kernel(config.optimizer_kernel, mesh.device))
        self.executor = Executor(self.model, mesh)  # micro-batches, step hooks, forward-only passes
        # The loss scale (fp16) and the all-ranks verdict on each step's gradients.
        self.guard = StepGuard(config.precision, mesh.axis("world"), mesh.device,
                               skip_nonfinite=config.skip_nonfinite, loss_scale=config.loss_scale)
        self.loss_fn = self.guard.loss_fn(task.loss_fn(self.executor))
        self.train_split, self.val_split, digest = task.load()
        self._check_same_corpus(digest)
        self.sampler = StepSampler(self.train_split.num_samples, config.global_batch, mesh.rank("dp"),
                                   mesh.size("dp"), config.micro_batch, config.seed,
                                   ordered=getattr(self.train_split, "ordered", False))
        task.eval_count(self.val_split)  # a held-out split too small to score fails now, not after training
        self.inference = Inference(self.executor, mesh, task, self.loss_fn, config.micro_batch)
        if getattr(self.train_split, "doc_mask", False):  # packed documents must not see each other: checked
            self.inference.check_documents(config.seq_len, task.vocab_size)
        self.measure = MeasurePolicy(config.measure, config.steps)
        self.metrics = Metrics(config.out, mesh, self.measure, task.unit,
                               config.global_batch * task.units_per_sample(), tuple(task.metric_labels))
        self.meter = ActivationMeter()
        self.update_times: list[float] = []  # the optimizer's part of each step
        self.resumed_from: str | None = None
        self.restarts = restart_count()  # fixed for this world's life: its launcher set it
        self.async_saves = checkpoint.AsyncSaves()
        self.preemption = Preemption()

    # -- one step ----------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        config, full = self.config, self.measure.full(step)
        comm.mark_step(self.mesh.ledger, step + 1)  # the flight recorder names steps in timeouts
        lr = lr_at(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._sync()  # a CUDA step is timed from an idle device to an idle device
        before, start = self.mesh.ledger.snapshot(), time.perf_counter()
        batches = [self.executor.batch(*self.task.batch(self.train_split, indices, step))
                   for indices in self.sampler.micro_batches(step)]
        self.executor.begin_step(self.guard.scaler.scale, len(batches))  # e.g. the balancing loss's scale
        loss, activations = self.executor.forward_backward(batches, self.loss_fn, measure=full, meter=self.meter,
                                                           read_loss=self.measure.reads_loss(full),
                                                           per_token=getattr(self.train_split, "per_token", False))
        self._sync()
        update_start, scale = time.perf_counter(), self.guard.scaler.scale
        grad_norm = self.guard.clip(step, self.model, self.optimizer, loss,
                                    config.grad_clip if config.grad_clip > 0 else math.inf)
        if grad_norm is not None:  # None: every rank agreed to skip this step (fp16 overflow)
            self.async_saves.before_update()  # a background save's copy of the weights is complete
            self.optimizer.step()
        self.guard.after_step(stepped=grad_norm is not None)
        extra = self.executor.end_step(self.mesh.ledger.since(before))  # e.g. the experts' routing counts
        self._sync()  # else the update's kernels are still running when its time is read
        self.update_times.append(time.perf_counter() - update_start)
        states = model_state_bytes(self.model, self.optimizer) if full else {}
        self.optimizer.zero_grad()
        local = {"loss": loss, "step_time_s": time.perf_counter() - start, "grad_norm": grad_norm,
                 **states, "activations_peak": activations, "comm": self.mesh.ledger.since(before)}
        record = self.metrics.step_record(step, lr, local, full)
        record.setdefault("grad_norm", None)  # --measure off keeps none; the line still names it
        record.update(loss_scale=scale, skipped=grad_norm is None, skipped_steps=self.guard.scaler.skipped, **extra)
        return record

    def _sync(self) -> None:
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)

    # -- the whole run -----------------------------------------------------------------------
    def run(self, progress: Any = None) -> None:
        """Train from where the run stands (a checkpoint's step, or 0) to `steps`, evaluating
        every `eval_every` steps and after the last. A resume that finds the run finished (its
        final checkpoint) trains nothing: the run's outputs are written again from it."""
        start = self.resume() if self.config.resume else 0
        self.measure.first_step = start
        self.metrics.open(start)
        self.preemption.install()
        try:
            for step in range(start, self.config.steps):
                self._maybe_flip_bit(step + 1)
                record = explained(self.task, lambda: self.train_step(step)) if step == start else self.train_step(step)
                if self._should_check(step + 1):
                    agreed = self.executor.check_replicas(self.optimizer, step + 1)
                    log.info("step %d: the %d blocks held by several ranks agree", step + 1, agreed)
                # A restarted world's steps say so, and which world (elastic restarts) ran them.
                record.update(restart=self.restarts, world_size=self.mesh.env.world_size,
                              grad_accum=self.config.grad_accum)
                if self._should_evaluate(step + 1):
                    record.update(self.evaluate())
                self.metrics.write(record)
                if progress:
                    progress(record)
                saved = self.save(step + 1) if self._should_save(step + 1) else None
                self._step_boundary(step + 1, saved)
            self.async_saves.finish()  # every write has finished before the run's outputs
        finally:
            self.preemption.uninstall()
            self.metrics.close()
        if not self.metrics.history:
            raise PlaitError(f"checkpoint {self.resumed_from} is the end of its run (step {start}), and "
                             f"{self.config.out} holds none of its metrics: there is nothing to train or report",
                             hint=f"raise --steps to train further, or export it: plait ckpt export "
                                  f"{self.resumed_from} --to FILE.safetensors")

    def _should_check(self, done: int) -> bool:
        """--check-replicas N: every N steps, and before each checkpoint (a saved one is a checked one)."""
        every = self.config.check_replicas
        return every > 0 and (done % every == 0 or self._should_save(done))

    def _maybe_flip_bit(self, step: int) -> None:
        """--inject bitflip:rank=R,step=S, in the first world only (a restart resumes clean)."""
        if not self.config.inject or os.environ.get(RESTART_ENV, "0") != "0":
            return
        rank, at = parse_bitflip(self.config.inject)
        if (rank, at) == (self.mesh.env.rank, step):
            name = self.executor.flip_bit(self.optimizer)
            console.say(f"plait: injected fault: rank {rank} flips one bit of {name} as step {step} begins")

    def _should_evaluate(self, done: int) -> bool:
        every = self.config.eval_every
        return done == self.config.steps or (every > 0 and done % every == 0)

    def evaluate(self) -> dict[str, float]:
        return self.inference.evaluate(self.val_split)

    def sample(self) -> str:
        """The task's closing sample (a language model's text continuation; collective)."""
        return self.task.sample(self.inference.next_logits, self.mesh.device)

    def _check_same_corpus(self, fingerprint: int) -> None:
        """Ranks on different machines may read different corpora; that breaks parity silently."""
        digest = torch.tensor([fingerprint], dtype=torch.int64, device=self.mesh.device)
        low, high = digest.clone(), digest.clone()
        comm.all_reduce(low, self.mesh.axis("world"), op="min", purpose=comm.TELEMETRY)
        comm.all_reduce(high, self.mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
        if low.item() != high.item():
            raise PlaitError("the ranks read different corpora", hint="give every node the same --data")

    # -- checkpoints -------------------------------------------------------------------------
    def _should_save(self, done: int) -> bool:
        every = self.config.save_every
        return every > 0 and (done % every == 0 or done == self.config.steps)

    def save(self, done: int) -> Path:
        """Checkpoint the state after `done` steps (in the background with --async-save:
        published at a later step boundary, or by `async_saves.finish()`)."""
        epoch, position = self.sampler.position(done)
        state = {"epoch": epoch, "position": position, "config": self.config.to_dict(),
                 "loss_scale": self.guard.scaler.state_dict()}
        root, keep, attach = Path(self.config.out) / "checkpoints", self.config.keep_checkpoints, self.task.attachments()
        if self.config.async_save:
            return self.async_saves.save(root, done, self.model, self.optimizer, self.mesh, state, keep, attach)
        return checkpoint.save(root, done, self.model, self.optimizer, self.mesh, state, keep=keep, attach=attach)

    def _step_boundary(self, done: int, saved: Path | None) -> None:
        """What every rank agrees on after each step, in one 8-byte all-reduce: whether any
        rank received SIGTERM or SIGUSR1 (plait.train.checkpoint.preempt), and whether any rank's
        background write is still running (else the pending save is published now)."""
        flags = torch.tensor([self.preemption.received or 0, int(self.async_saves.writing())], dtype=torch.int32,
                             device=self.mesh.device)
        comm.all_reduce(flags, self.mesh.axis("world"), op="max", purpose=comm.CONTROL)
        signal_number, writing = flags.tolist()
        saved = self.async_saves.poll(any_writing=bool(writing)) or saved
        if signal_number:
            self._stop_preempted(done, saved, Preemption.name(signal_number))

    def _stop_preempted(self, done: int, saved: Path | None, signal_name: str) -> None:
        """After SIGTERM or SIGUSR1 on any rank, every rank saves at this same step and stops;
        the CLI exits with EXIT_PREEMPTED."""
        if saved is None or saved.name != f"step-{done:08d}":
            saved = self.save(done)
        self.async_saves.finish()
        message = (f"preempted by {signal_name}: every rank stopped after step {done} of {self.config.steps} and "
                   f"saved {saved}; continue with --resume auto (exit code {EXIT_PREEMPTED})")
        raise Preempted(message if self.mesh.is_main else "")

    def resume(self) -> int:
        """Load model, optimizer and RNG from `--resume` (any layout); return the step to start
        at. A checkpoint at the last step is the finished run: nothing is left to train."""
        state = checkpoint_read.load(self.config.resume, self.model, self.optimizer, self.mesh)
        if state["step"] > self.config.steps:
            raise PlaitError(f"checkpoint {state['path']} is at step {state['step']}, past --steps {self.config.steps}",
                             hint=f"give --steps {state['step']} or more to continue it")
        self.guard.scaler.load_state_dict(state.get("loss_scale", {}))
        self.resumed_from = state["path"]
        return state["step"]
