"""A pretrained `hf:DIR` (its safetensors sharded into three files) on the meta path: 4 ranks.

argv: OUT CORPUS DIR... (local transformers directories with weights). For each, the real
Trainer trains 2 AdamW steps under every layout of LAYOUTS, and rank 0 alone trains the same
global batch in one process. Each run reports its losses and gradient norms, on rank 0 its
final weights' largest difference from the one-process run's, and what each rank read of
the files: the elements of every block it asked for, by tensor (plait.models.hf.weights), and whether
the model came through the meta path at all (a checkpoint transformers converts as it loads
is built whole).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from plait.families import family_of
from plait.models.hf import weights as hf_weights
from plait.runtime.mesh import init_mesh
from plait.train.checkpoint.read import Reader
from plait.train.config.settings import TrainConfig
from plait.train.loop import trainer as trainer_module
from plait.train.loop.run import final_weights
from plait.train.loop.trainer import Trainer
from tests.worldlib import save_report
from tests.worlds.hf_common import against_one_process

LAYOUTS = {
    "dp4": dict(dp=4),
    "zero3": dict(dp=4, zero=3),
    "tp2+sp": dict(dp=2, tp=2, sp=True),
    "pp2 uneven": dict(dp=2, pp=2, stage_layers="1,2"),
    "cp2": dict(dp=2, cp=2),
}
MOE_LAYOUTS = {"ep2": dict(dp=4, ep=2), "ep2 zero3": dict(dp=4, ep=2, zero=3)}
READ: dict[str, list[int]] = {}  # elements of each block this rank read from the files, by tensor
SLICED: set[str] = set()  # the file keys read for a fused tensor's block (a converted checkpoint's experts)
RESUMED: dict[str, list[int]] = {}  # elements of each piece read from a checkpoint while resuming, by key
SOURCES: list[str] = []


def _counting(block: Any) -> Any:
    def counted(self: Any, name: str, offsets: Any, lengths: Any) -> torch.Tensor:
        out = block(self, name, offsets, lengths)
        if name in self.where:
            READ.setdefault(name, []).append(out.numel())
        return out
    return counted


def _counting_slices(read: Any) -> Any:
    def counted(self: Any, key: str, block: Any) -> torch.Tensor:
        SLICED.add(key)
        return read(self, key, block)
    return counted


def _counting_resume(copy: Any) -> Any:
    def counted(self: Any, piece: dict[str, Any], out: torch.Tensor, offsets: Any) -> int:
        elements = copy(self, piece, out, offsets)
        if elements:
            RESUMED.setdefault(piece["key"].split("@")[0], []).append(elements)  # the tensor's name
        return elements
    return counted


def resumed_reads(config: TrainConfig) -> dict[str, list[int]]:
    """Train 2 steps saving each, then resume the same layout from step 1: the elements this
    rank read of each checkpoint tensor while resuming."""
    Trainer(replace(config, save_every=1), init_mesh(config.layout), family_of(config).task(config)).run()
    RESUMED.clear()
    resumed = replace(config, resume=str(Path(config.out) / "checkpoints" / "step-00000001"),
                      out=str(Path(config.out) / "resumed"))
    trainer = Trainer(resumed, init_mesh(config.layout), family_of(config).task(config))
    trainer.resume()
    return {name: list(sizes) for name, sizes in RESUMED.items()}


def _recording_source(build: Any) -> Any:
    def built(task: Any, seed: int) -> Any:
        model, source = build(task, seed)
        SOURCES.append(type(source).__name__ if source is not None else "whole")
        return model, source
    return built


def run(config: TrainConfig, mesh: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    READ.clear()
    SOURCES.clear()
    SLICED.clear()
    trainer = Trainer(config, mesh, family_of(config).task(config))
    read = {name: list(sizes) for name, sizes in READ.items()}
    sliced = sorted(SLICED)
    trainer.run()
    history = trainer.metrics.history
    return {"losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history],
            "read": read, "sliced": sliced, "source": SOURCES[0]}, final_weights(trainer)


def main() -> None:
    out, corpus, dirs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    hf_weights.SafetensorsWeights.block = _counting(hf_weights.SafetensorsWeights.block)
    hf_weights.SafetensorsWeights._slice = _counting_slices(hf_weights.SafetensorsWeights._slice)
    Reader._copy_overlap = _counting_resume(Reader._copy_overlap)
    trainer_module.build_on_meta = _recording_source(trainer_module.build_on_meta)
    report = {}
    for directory in dirs:
        name = Path(directory).name
        base = TrainConfig(model=f"hf:{directory}", data=corpus, steps=2, micro_batch=1, seq_len=16, eval_every=0,
                           eval_samples=4, sample_tokens=0, warmup_steps=1, lr=1e-3, nproc=1, dp=1)
        layouts = MOE_LAYOUTS if "moe" in name else LAYOUTS
        configs = {layout: replace(base, **fields, grad_accum=4 // fields["dp"], nproc=4, out=str(out / name / layout))
                   for layout, fields in layouts.items()}
        report[name] = against_one_process(run, replace(base, grad_accum=4, out=str(out / name / "one")), configs)
        if name == "llama":
            report["resumed_tp2+sp"] = resumed_reads(replace(configs["tp2+sp"], out=str(out / name / "resume")))
    save_report(report)


if __name__ == "__main__":
    main()
