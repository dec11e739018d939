"""The training loop: read top to bottom, one optimizer step at a time.

Every rank runs this same code. The strategies hide inside `parallelize` and
`build_optimizer`; the loop itself only knows to skip gradient sync on all but the last
micro-batch, and to gather a few numbers across ranks for the report. What the model is,
what a sample is, the loss and the metrics are the task's (plait.train.task): language
modelling with plait's GPT, or image classification with a ResNet.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from plait.api import parallelize
from plait.errors import PlaitError
from plait.models.gpt import TEMPERATURE, sample_next
from plait.parallel.compose import ParallelConfig, build_optimizer
from plait.parallel.data.sync import no_sync
from plait.parallel.pipeline.runner import PipelineRunner
from plait.parallel.precision import StepGuard, param_dtype, reduce_dtype_of
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.parallel.tensor.loss import gather_vocab
from plait.runtime import comm
from plait.runtime.mesh import AXES, Mesh
from plait.bench.meter import ActivationMeter, model_state_bytes, peak_process_bytes
from plait.train import checkpoint, checkpoint_read
from plait.train.config import TrainConfig
from plait.train.data import StepSampler
from plait.train.measure import MeasurePolicy
from plait.train.restart import restart_count
from plait.train.tasks import task_for

COMM_KEYS = [(axis, op) for axis in AXES for op in comm.OPS]
MEM_KEYS = ("params", "grads", "optim", "activations_peak")


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr · min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _parallelized(model: torch.nn.Module, mesh: Mesh, config: TrainConfig) -> torch.nn.Module:
    """`parallelize` with the run's options, the adapter picked by the model's class
    (plait/api.py; a model no adapter can split fails there with one PlaitError)."""
    return parallelize(model, mesh, ParallelConfig(
        bucket_mb=config.bucket_mb, zero=config.zero, offload=config.offload, sp=config.sp,
        virtual_stages=config.virtual_stages, recompute=config.recompute, sync_bn=config.sync_bn,
        reduce_dtype=reduce_dtype_of(config.precision, config.reduce_dtype)))


class Trainer:
    """Builds the model, optimizer and data for this rank, then trains."""

    def __init__(self, config: TrainConfig, mesh: Mesh):
        self.config, self.mesh = config, mesh
        torch.manual_seed(config.seed)
        self.task = task_for(config)
        self.model_config = self.task.model_config
        # The full model is built from the seed on every rank, then split: the same
        # initial weights whatever the layout.
        # With pp > 1, parallelize returns this rank's pipeline stages.
        dtype = param_dtype(config.precision)  # 16-bit weights: the fp32 masters live in the optimizer
        self.model = _parallelized(self.task.build_model(config.seed).to(dtype), mesh, config)
        self.runner: PipelineRunner | None = None
        self.optimizer = build_optimizer(self.model, torch.optim.AdamW, lr=config.lr, betas=(0.9, 0.95),
                                         weight_decay=config.weight_decay)
        if mesh.size("pp") > 1:
            self.runner = PipelineRunner(self.model, mesh, config.schedule)
        # The loss scale (fp16) and the all-ranks verdict on each step's gradients.
        self.guard = StepGuard(config.precision, mesh.axis("world"), mesh.device, skip_nonfinite=config.skip_nonfinite,
                               loss_scale=config.loss_scale)
        self.loss_fn = self.guard.loss_fn(self.task.loss_fn(self.model))
        self.train_split, self.val_split, digest = self.task.load()
        self._check_same_corpus(digest)
        self.sampler = StepSampler(self.train_split.num_samples, config.global_batch, mesh.rank("dp"),
                                   mesh.size("dp"), config.micro_batch, config.seed)
        self.eval_count = self._eval_count()
        self.meter = ActivationMeter()
        self.measure = MeasurePolicy(config.measure, config.steps)
        self.num_params = self.task.num_params
        self.history: list[dict[str, Any]] = []
        self.update_times: list[float] = []
        self.resumed_from: str | None = None
        self.val_accuracy: float | None = None
        self.restarts = restart_count()  # fixed for this world's life: its launcher set it

    # -- one step ------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        config, model = self.config, self.model
        comm.mark_step(self.mesh.ledger, step + 1)  # the flight recorder names steps in timeouts
        lr = lr_at(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        full = self.measure.full(step)
        if self.runner:
            self.runner.measure = full  # the barrier and the timeline's all-gather
        before = self.mesh.ledger.snapshot()
        start = time.perf_counter()
        batches = [self._batch(self.train_split, indices, step) for indices in self.sampler.micro_batches(step)]
        loss, activations = self._pipeline_step(batches) if self.runner else self._micro_steps(batches, full)
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        update_start = time.perf_counter()
        scale = self.guard.scaler.scale
        grad_norm, stepped = self.guard.step(step, model, self.optimizer, loss, max_norm)
        self.update_times.append(time.perf_counter() - update_start)  # the optimizer's part of the step
        states = model_state_bytes(model, self.optimizer) if full else {}
        self.optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        local = {"loss": loss, "step_time_s": elapsed, "grad_norm": float(grad_norm),
                 **states, "activations_peak": activations, "comm": self.mesh.ledger.since(before)}
        if full:
            record = self._gather_step(step, lr, local)
        else:
            record = self.measure.local_record(step, lr, local, self.config.global_batch * self.task.units_per_sample(),
                                               self.task.unit)
        record.update(grad_norm=record.get("grad_norm") if stepped else None, loss_scale=scale, skipped=not stepped,
                      skipped_steps=self.guard.scaler.skipped)
        return record

    def _micro_steps(self, batches: list[tuple[torch.Tensor, torch.Tensor]], full: bool = True) -> tuple[Any, int]:
        """Forward and backward each micro-batch; mean loss, and the bytes saved for backward.

        The loss is read back once per step (one host sync, not one per micro-batch), and
        not at all under `--measure off`; activations are metered only on measured steps."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for k, (inputs, targets) in enumerate(batches):
            last = k == len(batches) - 1
            # Only the last micro-batch synchronises: the others just accumulate locally.
            with contextlib.nullcontext() if last else no_sync(self.model):
                with self.meter.track(self.model) if full else contextlib.nullcontext():
                    logits = self.model(inputs)
                loss = self.loss_fn(logits, targets)
                (loss / len(batches)).backward()
            loss_sum += loss.detach()
        mean = loss_sum / len(batches)
        return (mean.item() if self.measure.reads_loss(full) else None), self.meter.last if full else 0

    def _pipeline_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
        """The schedule runs every micro-batch; gradients are reduced once at its end."""
        inputs, targets = zip(*batches)
        loss = self.runner.step(list(inputs), list(targets), self.loss_fn)
        return loss, self.runner.last_stats.peak_saved_bytes

    def _batch(self, split: Any, indices: list[int], step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.task.batch(split, indices, step)
        return inputs.to(self.mesh.device), targets.to(self.mesh.device)

    def _gather_step(self, step: int, lr: float, local: dict[str, Any]) -> dict[str, Any]:
        """Mean loss over dp ranks; max over all ranks for time, memory and traffic."""
        world = self.mesh.axis("world")
        device = self.mesh.device  # NCCL reduces device tensors only
        loss = torch.tensor([local["loss"]], dtype=torch.float64, device=device)
        comm.all_reduce(loss, self.mesh.axis("dp"), purpose=comm.TELEMETRY)
        maxed = torch.tensor([local["step_time_s"], *(local[k] for k in MEM_KEYS),
                              *(local["comm"].get(a, {}).get(o, 0.0) for a, o in COMM_KEYS)], dtype=torch.float64,
                             device=device)
        comm.all_reduce(maxed, world, op="max", purpose=comm.TELEMETRY)
        values = maxed.tolist()
        step_time, mem, traffic = values[0], values[1:1 + len(MEM_KEYS)], values[1 + len(MEM_KEYS):]
        comm_out: dict[str, dict[str, int]] = {}
        for (axis, op), wire in zip(COMM_KEYS, traffic):
            if wire:
                comm_out.setdefault(axis, {})[op] = round(wire)
        units, name = self.config.global_batch * self.task.units_per_sample(), self.task.unit
        return {
            "step": step + 1, "loss": loss.item() / self.mesh.size("dp"), "lr": lr,
            "grad_norm": local["grad_norm"], name: units, "step_time_s": step_time,
            f"{name}_per_s": units / step_time, "mem": dict(zip(MEM_KEYS, map(int, mem))), "comm": comm_out,
        }

    # -- evaluation and sampling -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss (next-token loss on the first `eval_samples` sequences; for
        images, over the whole validation split, also setting `val_accuracy`), split over dp."""
        if self.task.kind == "image":
            loss, self.val_accuracy = self.task.evaluate(self)
            return loss
        dp_rank, dp_size = self.mesh.rank("dp"), self.mesh.size("dp")
        count = self.eval_count
        mine = list(range(dp_rank, count, dp_size))
        batches = [self._batch(self.val_split, mine[i: i + self.config.micro_batch])
                   for i in range(0, len(mine), self.config.micro_batch)]
        tokens = sum(t.numel() for _, t in batches)
        if self.runner:
            mean = self.runner.eval_loss([x for x, _ in batches], [t for _, t in batches], self.loss_fn)
            total = torch.tensor([mean * tokens, tokens], dtype=torch.float64, device=self.mesh.device)
        else:
            summed = sum(self.loss_fn(self.model(x), t, reduction="sum").item() for x, t in batches)
            total = torch.tensor([summed, tokens], dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(total, self.mesh.axis("dp"), purpose=comm.TELEMETRY)
        return (total[0] / total[1]).item()

    @torch.no_grad()
    def sample_text(self) -> str:
        """A short continuation of the prompt, to see what the model learned."""
        if self.config.sample_tokens == 0 or self.task.kind != "lm":
            return ""
        codec = self.task.codec()  # bytes, or the tokenizer of the corpus or of the model
        prompt = torch.tensor([codec.encode(self.config.prompt)], dtype=torch.long, device=self.mesh.device)
        generator = torch.Generator(device=self.mesh.device).manual_seed(self.config.seed)
        if self.runner:
            out = self._generate_through_pipeline(prompt, generator)
        else:
            out = self.task.generate(self.model, prompt, self.config.sample_tokens, generator)
        return codec.decode(out[0].tolist())

    def _generate_through_pipeline(self, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """GPT.generate across stages: the last stage samples each token and sends it to all.

        Under SP the context is padded at its end to a multiple of tp (causal attention
        never lets a token see what follows it) and the logits are read before the padding.
        """
        info = tensor_parallel_of(self.model)
        multiple = info.axis.size if info is not None and info.sp else 1
        pp = self.mesh.axis("pp")
        for _ in range(self.config.sample_tokens):
            context = ids[:, -self.model_config.max_seq_len:]
            length = context.shape[1]
            padded = torch.nn.functional.pad(context, (0, -length % multiple))
            logits = self.runner.last_logits(padded, position=length - 1)
            token = torch.zeros((ids.shape[0], 1), dtype=ids.dtype, device=ids.device)
            if logits is not None:  # the last stage: every tp rank draws the same token
                logits = gather_vocab(logits, info.axis) if info is not None else logits
                token = sample_next(logits, TEMPERATURE, generator)
            comm.broadcast(token, pp, src=pp.size - 1, purpose=comm.TELEMETRY)
            ids = torch.cat((ids, token), dim=1)
        return ids

    def _eval_count(self) -> int:
        """Held-out sequences per evaluation: a multiple of dp, checked before training starts."""
        dp_size = self.mesh.size("dp")
        if self.task.kind == "image":
            return self.val_split.num_samples
        # A multiple of dp × micro-batch, so that every micro-batch has the same shape (the
        # pipeline agrees on shapes once).
        round_to = dp_size * self.config.micro_batch
        count = min(self.val_split.num_samples, max(self.config.eval_samples, round_to))
        count -= count % round_to
        if count == 0:
            raise PlaitError(
                f"the held-out split ({len(self.val_split.tokens)} tokens) has too few sequences of "
                f"{self.config.seq_len} tokens for {dp_size} dp rank(s)",
                hint="lower --seq-len, or give a larger --data",
            )
        return count

    def _check_same_corpus(self, fingerprint: int) -> None:
        """Ranks on different machines may read different corpora; that breaks parity silently."""
        digest = torch.tensor([fingerprint], dtype=torch.int64, device=self.mesh.device)
        low, high = digest.clone(), digest.clone()
        comm.all_reduce(low, self.mesh.axis("world"), op="min", purpose=comm.TELEMETRY)
        comm.all_reduce(high, self.mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
        if low.item() != high.item():
            raise PlaitError("the ranks read different corpora", hint="give every node the same --data")

    # -- the whole run -----------------------------------------------------------------------------
    def run(self, progress: Any = None) -> dict[str, Any]:
        """Train until `steps`, evaluating every `eval_every`; return the run's summary."""
        start = self.resume() if self.config.resume else 0
        self.measure.first_step = start
        metrics_file = self._open_metrics(start) if self.mesh.is_main else None
        val_losses: dict[int, float] = {}
        try:
            for step in range(start, self.config.steps):
                record = self.train_step(step)
                record["restart"] = self.restarts  # a restarted world's steps say so
                if self.config.eval_every and (step + 1) % self.config.eval_every == 0:
                    val_losses[step + 1] = record["val_loss"] = self.evaluate()
                    if self.val_accuracy is not None:
                        record["val_accuracy"] = self.val_accuracy
                self.history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if progress:
                    progress(record)
                if self._should_save(step + 1):
                    self.save(step + 1)
        finally:
            if metrics_file:
                metrics_file.close()
        if self.config.steps not in val_losses:
            val_losses[self.config.steps] = self.evaluate()
        summary = self.summary(val_losses)
        if self.val_accuracy is not None:
            summary["val_accuracy"] = self.val_accuracy
        return summary

    # -- checkpoints -------------------------------------------------------------------------------
    def _should_save(self, done: int) -> bool:
        every = self.config.save_every
        return every > 0 and (done % every == 0 or done == self.config.steps)

    def save(self, done: int) -> Path:
        epoch, position = self.sampler.position(done)
        state = {"epoch": epoch, "position": position, "config": self.config.to_dict(),
                 "loss_scale": self.guard.scaler.state_dict()}
        return checkpoint.save(Path(self.config.out) / "checkpoints", done, self.model, self.optimizer,
                               self.mesh, state, keep=self.config.keep_checkpoints, attach=self.task.attachments())

    def resume(self) -> int:
        """Load model, optimizer and RNG from `--resume` (any layout); return the step to start at."""
        state = checkpoint_read.load(self.config.resume, self.model, self.optimizer, self.mesh)
        if state["step"] >= self.config.steps:
            raise PlaitError(f"checkpoint {state['path']} is at step {state['step']}, not before --steps {self.config.steps}",
                             hint="raise --steps to train further")
        self.guard.scaler.load_state_dict(state.get("loss_scale", {}))
        self.resumed_from = state["path"]
        return state["step"]

    def _open_metrics(self, start: int) -> Any:
        """metrics.jsonl, keeping the lines of steps before `start` when resuming into the same --out."""
        path = Path(self.config.out) / "metrics.jsonl"
        kept = []
        if start and path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start]
        handle = open(path, "w")
        handle.writelines(line + "\n" for line in kept)
        return handle

    def summary(self, val_losses: dict[int, float]) -> dict[str, Any]:
        """What the closing report and summary.json show."""
        history, dp = self.history, self.mesh.size("dp")
        times = [r["step_time_s"] for r in history[1:]] or [history[0]["step_time_s"]]
        param_bytes = self.num_params * reduce_dtype_of(self.config.precision, self.config.reduce_dtype).itemsize
        peak = torch.tensor([peak_process_bytes(self.mesh.device)], dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(peak, self.mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
        return {
            "model": self.config.model, "num_params": self.num_params,
            "layout": {"dp": dp, "tp": self.mesh.size("tp"), "pp": self.mesh.size("pp"),
                       "zero": self.config.zero, "offload": self.config.offload, "sp": self.config.sp,
                       "recompute": self.config.recompute, "sync_bn": self.config.sync_bn, "precision": self.config.precision,
                       "schedule": self.config.schedule if self.runner else None, "world_size": self.mesh.env.world_size,
                       "launcher": self.mesh.env.launcher, "backend": self.mesh.backend or "none"},
            "global_batch": self.config.global_batch, "seq_len": self.config.seq_len, "task": self.task.kind,
            "steps": len(history), "resumed_from": self.resumed_from, "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "val_loss": val_losses[max(val_losses)], "val_losses": val_losses,
            "loss_scale": self.guard.scaler.scale, "skipped_steps": self.guard.scaler.skipped,
            "step_time_s_median": statistics.median(times),
            f"{self.task.unit}_per_s": self.config.global_batch * self.task.units_per_sample() / statistics.median(times),
            "comm_per_step": history[-1]["comm"],
            "comm_formula": {"dp": {"all_reduce": comm.ring_wire_bytes("all_reduce", param_bytes, dp)}}
            if dp > 1 and self.mesh.env.world_size == dp and not self.config.zero else {},
            "comm_naive_total": comm.naive_exchange_bytes(param_bytes, dp),
            "comm_ring_total": comm.ring_wire_bytes("all_reduce", param_bytes, dp) * dp,
            "mem": {k: max(r["mem"][k] for r in history if "mem" in r) for k in MEM_KEYS},
            "measure": self.config.measure,
            "peak_process_bytes": int(peak.item()),
            "telemetry_bytes": sum(sum(ops.values()) for ops in self.mesh.ledger.wire(comm.TELEMETRY).values()),
            "predicted": (predicted := self.prediction()),
            "step_time": self._step_time(predicted, statistics.median(times)) if self.task.kind == "lm" else {},
        }

    def _step_time(self, predicted: dict[str, Any], measured: float) -> dict[str, Any]:
        from plait.train.timing import step_time_parts

        return step_time_parts(self, predicted, measured)

    def prediction(self) -> dict[str, Any]:
        """What `plait estimate` says this very layout costs, beside the measurements: for a
        language model on this run's own hardware (its --hardware-file, else this machine's
        calibration); a CNN's prediction has no time (plait.train.image_task)."""
        shape = self.mesh.shape
        layout = dict(dp=shape.dp, tp=shape.tp, pp=shape.pp, zero=self.config.zero, offload=self.config.offload,
                      sp=self.config.sp, schedule=self.config.schedule, virtual_stages=self.config.virtual_stages,
                      precision=self.config.precision, micro_batch=self.config.micro_batch,
                      grad_accum=self.config.grad_accum, recompute=self.config.recompute,
                      reduce_dtype=self.config.reduce_dtype)
        if self.task.kind != "lm":
            return self.task.prediction(**layout, hardware="cpu")
        from plait.train.timing import run_hardware

        hardware, source = run_hardware(self)
        result = self.task.prediction(**layout, hardware=hardware)
        result["hardware_source"] = source
        return result
