"""One rank's whole life: join the job, train, write the outputs, report, leave.

The outputs are always enough to give the model back: the whole model's weights in OUT, as
transformers writes them (OUT/model.safetensors, or above --max-shard-size its shards with
model.safetensors.index.json; tied ones once), and the task's attached files beside them (a
Hugging Face model's config.json and tokenizer), which `plait ckpt export OUT --hf DIR` reads
when the run saved no checkpoint. The weights are written a few tensors at a time, gathered
from the ranks that hold them: no rank assembles the model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from plait.estimate.layout import Workload
from plait.parallel.compiled import cache_dir, compile_stats, is_compiled
from plait.parallel.precision import reduce_dtype_of
from plait.report import report_after_training
from plait.rules import doc_mask_on, estimate_device
from plait.runtime import comm, console
from plait.runtime.env import prepare_host
from plait.runtime.mesh import init_mesh
from plait.train.checkpoint.read import RUN_ATTACHED
from plait.train.checkpoint.shards import Entry, ShardWriter
from plait.train.config.check import parse_bytes
from plait.train.config.settings import TrainConfig
from plait.train.observe.logs import setup_logging
from plait.report.closing import closing_report
from plait.train.observe.tboard import TensorBoardLog
from plait.train.observe.timing import run_hardware, step_time_parts
from plait.train.loop.trainer import Trainer



def train(config: TrainConfig, family: Any) -> dict[str, Any]:
    """Run `plait train` on this rank; rank 0 writes outputs and prints the report."""
    setup_logging(config.log_level)
    mesh = init_mesh(config.layout, backend=config.backend, timeout_s=config.timeout_s)
    try:
        prepare_host(int(os.environ.get("LOCAL_WORLD_SIZE", mesh.env.world_size)))
        trainer = Trainer(config, mesh, family.task(config))
        bar = _progress_bar(config.steps) if mesh.is_main else None
        board = TensorBoardLog(config.out) if config.tensorboard and mesh.is_main else None
        try:
            trainer.run(progress=(lambda r: _on_step(r, bar, board, trainer.task.unit)) if bar else None)
        finally:
            if board:
                board.close()
            if bar:
                bar.close()
        return finish(trainer)
    finally:
        mesh.close()


def finish(trainer: Trainer) -> dict[str, Any]:
    """What every run ends with, on every rank (several steps are collective): the sample,
    the prediction, the weights, the summary (returned); then on the main rank the files and
    the closing report."""
    config, mesh = trainer.config, trainer.mesh
    comm.mark_step(mesh.ledger, config.steps + 1)  # the closing phase: named so by timeouts, and by PLAIT_INJECT
    sample = trainer.sample()  # every rank: with tensor parallelism or ZeRO-3 a forward is collective
    written = write_weights(trainer, Path(config.out))  # every rank: each group is gathered to the main rank
    extras = trainer.metrics.gather_extras(trainer.update_times, trainer.start_bytes)  # the peak includes that writing
    described = describe_run(trainer, prediction(trainer))
    summary = trainer.metrics.summary(described, extras, trainer.executor.summary(trainer.metrics.history))
    summary["step_time"] = step_time_parts(summary["predicted"], summary["step_time_s_median"], extras["optimizer_s"])
    summary.update(sample=sample, config=config.to_dict(), restarts=trainer.restarts)
    if compiles(trainer.model, config) and len(trainer.metrics.history) > trainer.metrics.kept:
        first = trainer.metrics.history[trainer.metrics.kept]  # this world's first step, where it compiled
        summary["compile"] = compile_summary(first["step_time_s"], summary["step_time_s_median"])
    if not mesh.is_main:
        return summary
    out = Path(config.out)
    write_outputs(summary, written, out, trainer.task.attachments())
    save_timeline(trainer, out)
    print(closing_report(summary, config.out), flush=True)
    if not config.no_report and os.environ.get("PLAIT_REPORT", "on") != "off":
        print(report_after_training(out), flush=True)
    return summary


def compiles(model: Any, config: TrainConfig) -> bool:
    """Whether this run compiles anything: its blocks (--compile) or its update
    (--optimizer-kernel compiled, which compiles at the first step without --compile): either
    way the closing report says what compiling cost."""
    return is_compiled(model) or config.compiles_update


def compile_summary(first_step_s: float, median_s: float) -> dict[str, Any]:
    """What compiling cost this world: the first step's excess over the median (compilation
    happens there, forward and backward), the graphs, the graph breaks and the cache's answers."""
    return {"seconds": max(0.0, first_step_s - median_s), "first_step_s": first_step_s,
            "cache_dir": str(cache_dir()), **compile_stats()}


MEASURED_KINDS = ("params", "grads", "optim", "activations")  # the memory kinds Metrics measures per rank


def prediction(trainer: Trainer) -> dict[str, Any]:
    """What `plait estimate` says this very run costs, on this run's own hardware profile (its
    --hardware-file, else this machine's calibration: collective, see plait.train.observe.timing)."""
    config = trainer.config
    packed = getattr(trainer.train_split, "doc_mask", False)
    mask = doc_mask_on(trainer.mesh.device.type) if packed else ""
    work = Workload.of(trainer.mesh.layout, **config.work(), doc_mask=mask,
                       device=estimate_device(trainer.mesh.device.type))
    hardware, source = run_hardware(trainer)
    result = trainer.task.prediction(work, hardware)
    result["hardware_source"] = source
    if result.get("stages"):  # measured: each kind's largest rank (Metrics); predicted alike, per kind
        for kind in MEASURED_KINDS:
            result["memory"][kind] = max(row["memory"][kind] for row in result["stages"])
        # Its total and stage stay the busiest rank's (plait estimate's figure), not these kinds' sum.
    return result


def describe_run(trainer: Trainer, predicted: dict[str, Any]) -> dict[str, Any]:
    """The run as the summary names it: model, layout, task, batch, precision state, prediction."""
    config, mesh, task = trainer.config, trainer.mesh, trainer.task
    layout = {**mesh.layout.as_dict(), "recompute": config.recompute, "sync_bn": config.sync_bn,
              "precision": config.precision, "world_size": mesh.env.world_size, "launcher": mesh.env.launcher,
              "backend": mesh.backend or "none"}
    return {
        "model": config.model, "num_params": task.num_params, "layout": layout,
        "global_batch": config.global_batch, "seq_len": config.seq_len,
        "task": {"unit": task.unit, "batch": task.batch_text(config.global_batch), "metrics": task.metric_labels},
        "resumed_from": trainer.resumed_from, "loss_scale": trainer.guard.scaler.scale,
        "skipped_steps": trainer.guard.scaler.skipped, "predicted": predicted,
        "reduce_bytes": reduce_dtype_of(config.precision, config.reduce_dtype).itemsize,
        **blend_summary(trainer),
    }


def blend_summary(trainer: Trainer) -> dict[str, Any]:
    """{"blend": each corpus's asked and realised share of the run's sequences} for a blended
    --data (plait.train.data.blend), else nothing."""
    from plait.train.data.tokens import blend_parts

    parts = blend_parts(trainer.config.data)
    realised = getattr(trainer.train_split, "realised", None)
    if not parts or realised is None:
        return {}
    samples = trainer.config.steps * trainer.config.global_batch
    total = sum(p.weight for p in parts)
    return {"blend": {"samples": samples, "parts": [
        {"source": p.source, "weight": p.weight / total, "realised": share}
        for p, share in zip(parts, realised(samples))]}}


def _progress_bar(steps: int) -> Any:
    """Rank 0's bar, drawn through console.BarStream: the other ranks and the spawner, writing
    to the same stderr, then know to start their lines on a fresh one."""
    from tqdm import tqdm

    return tqdm(total=steps, desc="train", unit="step", mininterval=1.0, dynamic_ncols=True,
                file=console.BarStream(sys.stderr))


def _on_step(record: dict[str, Any], bar: Any, board: TensorBoardLog | None, unit: str) -> None:
    postfix = {f"{unit[:3]}/s": f"{record[f'{unit}_per_s']:,.0f}"}
    if record.get("loss") is not None:  # --measure off reads no loss between the measured steps
        postfix["loss"] = f"{record['loss']:.3f}"
    if "val_loss" in record:
        postfix["val"] = f"{record['val_loss']:.3f}"
    bar.set_postfix(postfix, refresh=False)
    bar.update(record["step"] - bar.n)  # a resumed run starts past 0
    if board:
        board.write(record)


def save_timeline(trainer: Trainer, out: Path) -> None:
    """The last step's measured pipeline timeline, as timeline.json for `plait report`."""
    timeline = trainer.executor.timeline()
    if timeline is not None:
        (out / "timeline.json").write_text(json.dumps(timeline) + "\n")


def write_weights(trainer: Trainer, out: Path) -> list[Path]:
    """The trained weights into `out` as sharded safetensors (checkpoint/shards.py), sent to the
    main rank a block at a time (each rank's part of each tensor), which writes each block
    where it lies in the file: no tensor is ever assembled (collective; the files written, on
    the main rank)."""
    plan, blocks = trainer.executor.weight_blocks(trainer.optimizer)
    writer = None
    if trainer.mesh.is_main:
        out.mkdir(parents=True, exist_ok=True)
        writer = ShardWriter(out, [Entry(name, shape, dtype) for name, shape, dtype in plan],
                             parse_bytes(trainer.config.max_shard_size))
    try:
        for name, block, offsets, shape in blocks:
            writer.write_block(name, block, offsets, shape)  # type: ignore[union-attr]
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return writer.close() if writer is not None else []


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """The whole model's weights for the main rank to write, tied ones once (None on the
    other ranks; every rank takes part): the executor's one in-memory route for any layout."""
    return trainer.executor.whole_weights(trainer.optimizer)


def write_outputs(summary: dict[str, Any], weights: list[Path], out: Path, attachments: dict[str, Path]) -> None:
    """summary.json (naming the weights' files, written already: write_weights) and the task's
    attached files, so that the run's own outputs can always be exported."""
    summary["weights"] = [path.name for path in weights]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, source in attachments.items():
        target = out / RUN_ATTACHED / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
