"""What every language-model family checks before spawning: its shape against the layout.

The GPT presets and a Hugging Face directory both describe a decoder by a `GPTConfig`
(plait.models.gpt.config); the checks that read only that shape and the run's options live
here once, and each family adds its own (a preset's trainability, a directory's tokenizer).
"""

from __future__ import annotations

from typing import Any

from plait.errors import PlaitError
from plait.models.gpt.config import GPTConfig
from plait.rules import check_context_split, check_pipeline_cut, parse_stage_layers

# What a language model reads of the settings only some families read (plait.train.config.applies).
LANGUAGE_READS = frozenset({"packing", "doc_mask", "prompt"})


def check_language_run(config: Any, shape: GPTConfig) -> None:
    """--seq-len within the model's positions, tp splitting its heads and widths (and the
    sequence under SP), the pipeline cutting its layers, no BatchNorm to sync, a corpus."""
    spec = config.model
    if config.seq_len > shape.max_seq_len:
        raise PlaitError(f"--seq-len {config.seq_len} is longer than --model {spec} allows ({shape.max_seq_len})",
                         hint=f"use --seq-len {shape.max_seq_len} or less")
    if config.sync_bn:
        raise PlaitError(f"--sync-bn shares BatchNorm statistics, and --model {spec} has no BatchNorm",
                         hint="drop --sync-bn, or train a ResNet (--model resnet18 --data digits)")
    check_context_split(config.seq_len, config.cp, config.tp, config.sp, shape.n_heads, config.cp_kind)
    if config.tp > 1:
        shape.check_split(config.tp, config.sp, config.seq_len)
    if config.pp > 1:
        check_pipeline_cut(shape.n_layers, config.pp, config.virtual_stages, parse_stage_layers(config.stage_layers),
                           shape.block_runs)
    check_corpus(config.data)


def check_corpus(source: str) -> None:
    """--data exists and can be used whole: a prepared corpus passes its cheap checks, raw
    text is small enough to hold (the full checksum waits for the ranks: plait/train/data/tokens.py)."""
    from plait.train.data.tokens import BUILTIN, blend_parts, check_blend, check_tokens, is_prepared, raw_files

    parts = blend_parts(source)
    if parts:  # each part as a corpus of its own, then alike
        for part in parts:
            check_corpus(part.source)
        check_blend(source)
        return
    if is_prepared(source):
        check_tokens(source, full=False)
    elif source not in BUILTIN:
        raw_files(source)


def doc_mask_before_launch(config: Any) -> str:
    """The packed documents' mask a run will build, as Workload.doc_mask names it, known before
    the corpus's tokens are read: with --doc-mask true, or "auto" on a prepared corpus of
    completions or chats (its index says: plait.train.data.tokens.fine_tuning_corpus),
    FlexAttention's block tables on a GPU, SDPA's dense mask on a CPU
    (plait.rules.doc_mask_on, the device guessed as `ranks_on_gpu` does); none
    otherwise."""
    from plait.rules import doc_mask_on
    from plait.train.config.settings import ranks_on_gpu
    from plait.train.data.tokens import fine_tuning_corpus

    if config.doc_mask == "false" or (config.doc_mask == "auto" and not fine_tuning_corpus(config.data)):
        return ""

    return doc_mask_on("cuda" if ranks_on_gpu(config) else "cpu")


def estimated_memory(shape_of: Any) -> Any:
    """A language family's price of a layout for --memory-limit: plait estimate's peak per
    rank (its device total and the largest transient of setup or of writing the outputs)
    for the run's batch and options, with the family's shape of --model."""

    def memory(config: Any, layout: Any) -> float:
        from plait.estimate import estimate_layout
        from plait.estimate.layout import Workload
        from plait.rules import estimate_device
        from plait.train.config.settings import ranks_on_gpu

        work = Workload.of(layout, **config.work(), doc_mask=doc_mask_before_launch(config),
                           device=estimate_device("cuda" if ranks_on_gpu(config) else "cpu"))
        memory = estimate_layout(shape_of(config.model), work, hardware="cpu")["memory"]
        return float(memory.get("peak") or memory["total"])

    return memory
