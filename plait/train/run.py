"""One rank's whole life: join the job, train, write the outputs, report, leave."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from plait.report import report_after_training
from plait.runtime.env import set_cpu_threads
from plait.runtime.mesh import init_mesh
from plait.train.config import TrainConfig
from plait.train.logs import setup_logging
from plait.train.report import closing_report
from plait.train.tboard import TensorBoardLog
from plait.train.trainer import Trainer


def train(config: TrainConfig) -> dict[str, Any]:
    """Run `plait train` on this rank; rank 0 writes outputs and prints the report."""
    setup_logging(config.log_level)
    mesh = init_mesh(dp=config.dp, tp=config.tp, pp=config.pp, backend=config.backend, timeout_s=config.timeout_s)
    try:
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", mesh.env.world_size)))
        trainer = Trainer(config, mesh)
        bar = _progress_bar(config.steps) if mesh.is_main else None
        board = TensorBoardLog(config.out) if config.tensorboard and mesh.is_main else None
        try:
            summary = trainer.run(progress=(lambda r: _on_step(r, bar, board)) if bar else None)
        finally:
            if board:
                board.close()
        if bar:
            bar.close()
        # Every rank takes part: with tensor parallelism or ZeRO-3 a forward is collective.
        summary["sample"] = trainer.sample_text()
        weights = final_weights(trainer)
        if mesh.is_main:
            summary["config"] = config.to_dict()
            summary["restarts"] = trainer.restarts
            _write_outputs(summary, weights, Path(config.out))
            save_timeline(trainer, Path(config.out))
            print(closing_report(summary, config.out), flush=True)
            if not config.no_report and os.environ.get("PLAIT_REPORT", "on") != "off":
                print(report_after_training(Path(config.out)), flush=True)
        return summary
    finally:
        mesh.close()


def _progress_bar(steps: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="train", unit="step", mininterval=1.0, dynamic_ncols=True)


def _on_step(record: dict[str, Any], bar: Any, board: TensorBoardLog | None) -> None:
    _advance(bar, record)
    if board:
        board.write(record)


def _advance(bar: Any, record: dict[str, Any]) -> None:
    postfix = {f"{unit[:3]}/s": f"{record[f'{unit}_per_s']:,.0f}" for unit in ("tokens", "images")
               if f"{unit}_per_s" in record}
    if record.get("loss") is not None:  # --measure off reads no loss between the measured steps
        postfix["loss"] = f"{record['loss']:.3f}"
    if "val_loss" in record:
        postfix["val"] = f"{record['val_loss']:.3f}"
    bar.set_postfix(postfix, refresh=False)
    bar.update(record["step"] - bar.n)  # a resumed run starts past 0


def save_timeline(trainer: Trainer, out: Path) -> None:
    """The last step's measured pipeline timeline, as timeline.json for `plait report`."""
    timeline = trainer.runner.last_timeline if trainer.runner is not None else None
    if timeline is not None:
        from plait.parallel.pipeline.timeline import timeline_to_dict

        (out / "timeline.json").write_text(json.dumps(timeline_to_dict(timeline)) + "\n")


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """The whole model's weights for the main rank to write (every rank takes part:
    collective under TP and ZeRO-3; other ranks may get them too, or None). A pipeline's
    stages live on different ranks: they are assembled the way a checkpoint is, through its
    pieces, written to a scratch directory and read back."""
    if trainer.runner is not None:
        return _assembled_from_pieces(trainer)
    from plait.parallel.tensor.plan import gather_full_params
    from plait.parallel.zero.stages import full_parameters

    with full_parameters(trainer.model) as model:
        weights = gather_full_params(model)
    if getattr(trainer.model_config, "tie_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied: stored once, as embed.weight
    return weights


def _assembled_from_pieces(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    import shutil

    from plait.train import checkpoint
    from plait.train.checkpoint_read import Reader, model_weights

    scratch = Path(trainer.config.out) / ".final-weights"
    path = checkpoint.save(scratch, len(trainer.history), trainer.model, trainer.optimizer, trainer.mesh, {},
                           keep=1, only="model/")
    if not trainer.mesh.is_main:
        return None
    weights = model_weights(Reader(path))
    shutil.rmtree(scratch)
    return weights


def _write_outputs(summary: dict[str, Any], weights: dict[str, torch.Tensor] | None, out: Path) -> None:
    """summary.json and the trained weights (one plain safetensors file, tied weights once)."""
    from safetensors.torch import save_file

    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if weights is not None:
        save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(out / "model.safetensors"))
