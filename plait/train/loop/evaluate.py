"""`plait eval`: a language model's mean next-token loss over every loss-carrying token of
every document of a corpus, and its perplexity, under any layout.

    plait eval --model hf:my-model --data data/chats --tp 2 --json
    plait eval --model runs/latest --data data/corpus            # a finished run's weights

The model is built as `plait train` builds it (on the meta device, each rank reading its
slices): a preset or hf:DIR from its own weights (or the seed), or a run's --out from the
weights that run wrote. The corpus is scored whole, not its held-out part: every document,
packed by best-fit with document masks by default (`--packing`, `--doc-mask`: each document
then scored as if alone), each sequence dealt to the dp ranks and the sums added over them
(plait.train.loop.inference), so the figure is the same for every layout. `--json` prints
one object: loss, perplexity, tokens, documents (and the pieces documents longer than
--seq-len were cut into, whose first tokens are not scored).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from plait.errors import PlaitError
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.trainer import build_parallel

EVAL_FIELDS = ("model", "imports", "data", "seq_len", "micro_batch", "packing", "doc_mask", "seed", "dp", "tp", "sp",
               "pp", "cp", "cp_kind", "ep", "schedule", "virtual_stages", "stage_layers", "precision", "zero",
               "nproc", "backend", "timeout_s", "log_level")  # the train flags that apply to an evaluation
SUMMARY = "summary.json"


def run_model_spec(spec: str) -> tuple[str, Path | None]:
    """(--model for the family, the run directory whose weights to read): a run's --out
    (summary.json beside its weights) names the model it trained."""
    path = Path(spec)
    if not (path.is_dir() and (path / SUMMARY).is_file()):
        return spec, None
    try:
        summary = json.loads((path / SUMMARY).read_text())
        model, weights = summary["model"], summary["weights"]
    except (OSError, ValueError, KeyError, TypeError):
        raise PlaitError(f"--model {spec}: {path / SUMMARY} does not name the model and its weights",
                         hint="give the --out of a finished `plait train` run, a preset or hf:DIR") from None
    if not isinstance(model, str) or not isinstance(weights, list) or not weights:
        raise PlaitError(f"--model {spec}: {path / SUMMARY} names no weights (the run did not finish)",
                         hint="evaluate a finished run, or resume it to its end first")
    if model.startswith("hf:") and not Path(model[3:]).is_dir():
        from plait.train.checkpoint.read import RUN_ATTACHED

        model = f"hf:{path / RUN_ATTACHED / 'hf'}"  # the config the run kept beside its weights
    return model, path


class RunFiles:
    """A run's --out as a directory of safetensors weights (what SafetensorsWeights reads)."""

    def __init__(self, run_dir: Path):
        summary = json.loads((run_dir / SUMMARY).read_text())
        self.path, self.weights = run_dir, [run_dir / name for name in summary["weights"]]
        missing = [p for p in self.weights if not p.is_file()]
        if missing:
            raise PlaitError(f"--model {run_dir}: {missing[0].name}, named by {SUMMARY}, is missing",
                             hint="copy the whole run directory")


def whole_corpus(task: Any, config: TrainConfig) -> tuple[Any, int]:
    """Every document of `--data` as sequences (best-fit with document masks unless the flags
    say otherwise), and how many documents there are (0 for a stream of text)."""
    from plait.train.data.corpus import Split, document_split
    from plait.train.data.packing import packing_for

    tokens = task.corpus()
    ends = getattr(tokens, "plait_documents", None)
    if ends is None:
        packing_for(tokens, config.packing, config.doc_mask)  # refuses best-fit or masks without documents
        return Split(tokens, config.seq_len), 0
    packing = packing_for(tokens, "best-fit" if config.packing == "auto" else config.packing,
                          "true" if config.doc_mask == "auto" else config.doc_mask)
    return document_split(tokens, ends, np.ones(len(ends), dtype=bool), config.seq_len, packing), len(ends)


def evaluate(config: TrainConfig, family: Any, run_dir: Path | None) -> dict[str, Any]:
    """The loss over the whole corpus on this rank's share of the layout (collective); the
    result on every rank."""
    from plait.parallel.executor import Executor
    from plait.runtime.env import prepare_host
    from plait.train.loop.inference import Inference
    from plait.train.observe.logs import setup_logging

    setup_logging(config.log_level)
    mesh = init_mesh(config.layout, backend=config.backend, timeout_s=config.timeout_s)
    try:
        prepare_host(int(os.environ.get("LOCAL_WORLD_SIZE", mesh.env.world_size)))
        task = family.task(config)
        if not callable(getattr(task, "corpus", None)):
            raise PlaitError(f"plait eval scores language models, and --model {config.model} is not one",
                             hint="evaluate plait's GPT or a transformers causal LM")
        if run_dir is not None:
            from plait.models.hf.weights import SafetensorsWeights

            files = RunFiles(run_dir)
            task.meta_build = True
            task.weights = lambda model, seed: SafetensorsWeights(files, model, seed)  # type: ignore[method-assign]
        executor = Executor(build_parallel(task, config, mesh), mesh)
        split, documents = whole_corpus(task, config)
        if split.num_samples == 0:
            raise PlaitError(f"--data {config.data} holds no sequence of {config.seq_len} tokens",
                             hint="lower --seq-len")
        inference = Inference(executor, mesh, task, task.loss_fn(executor), config.micro_batch)
        totals = inference.totals(split)
    finally:
        mesh.close()
    loss = totals["loss"] / max(totals["tokens"], 1.0)
    pieces = split.documents_in(split.num_samples) if hasattr(split, "documents_in") else documents
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(totals["tokens"]),
            "documents": documents, "pieces": pieces, "model": config.model, "data": config.data,
            "layout": {k: getattr(config.layout, k) for k in ("dp", "tp", "pp", "cp", "ep", "zero")}}


def eval_line(result: dict[str, Any]) -> str:
    """The evaluation as one line for people."""
    cut = result["pieces"] - result["documents"] if result["documents"] else 0
    note = f"; {cut} piece(s) of documents longer than --seq-len, their first tokens unscored" if cut > 0 else ""
    what = f"{result['documents']:,} documents" if result["documents"] else "a stream of text"
    return (f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over {result['tokens']:,} "
            f"loss-carrying tokens of {what} ({result['data']}){note}")


def eval_config(config: TrainConfig) -> TrainConfig:
    """What an evaluation runs: no steps, every sequence scored (eval_samples unbounded)."""
    return replace(config, eval_samples=1 << 62)
