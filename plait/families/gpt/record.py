"""plait's own GPT (plait/models/gpt/model.py) as a family: `--model tiny`, `--model small,n_layers=4`.

A preset names a `GPTConfig` (plait/models/gpt/config.py), any field overridable after the name.
The shape-only presets (llama-7b...) exist for `plait estimate`; training refuses them. On a
prepared corpus the vocabulary follows the data unless the user set it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from plait.errors import PlaitError
from plait.families.language import LANGUAGE_READS, check_language_run, estimated_memory
from plait.families.record import Family
from plait.rules import check_experts_split
from plait.models.gpt.config import PRESETS, TRAINABLE, GPTConfig, get_preset, preset_name


def matches(model: str) -> bool:
    return preset_name(model) in PRESETS


def resolve(config: Any) -> Any:
    """The vocabulary follows a prepared corpus (plait.train.data.tokens.model_for_data)."""
    from plait.train.data.tokens import model_for_data

    return replace(config, model=model_for_data(config.model, config.data))


def check(config: Any) -> None:
    shape = get_preset(config.model)  # raises naming the presets, or the override that is wrong
    if preset_name(config.model) not in TRAINABLE:
        raise PlaitError(f"model preset {config.model!r} is shape-only (for estimates)",
                         hint=f"train one of: {', '.join(TRAINABLE)}; use `plait estimate --model {config.model}`")
    if shape.mlp_matrices == 2:  # the estimate would price a model plait's GPT does not build
        raise PlaitError(f"--model {config.model}: mlp_matrices=2 describes a GELU or relu² MLP for plait estimate, "
                         "and plait's GPT trains a SwiGLU MLP (three matrices)",
                         hint="drop mlp_matrices (or set it to 3) to train; train a two-matrix model as hf:DIR")
    if shape.qk_norm or not shape.vocab_split or shape.whole_sequence_ends or not shape.lean_blocks:
        raise PlaitError(f"--model {config.model}: qk_norm, vocab_split, whole_sequence_ends and lean_blocks "
                         "describe a transformers family for plait estimate; plait's GPT has no q/k norms, splits "
                         "its vocabulary under tp and its sequence at the embedding under sp, and keeps lean blocks",
                         hint="drop qk_norm, vocab_split, whole_sequence_ends and lean_blocks to train it")
    check_language_run(config, shape)
    check_experts_split(shape.experts, config.ep)
    if shape.is_moe and shape.capacity_factor > 0 and config.cp > 1:
        raise PlaitError(f"--model {config.model}: an expert's capacity counts the tokens of one forward, and under "
                         f"cp {config.cp} a rank holds part of each sequence, so it would drop other tokens than one "
                         "process", hint="drop --cp, or train dropless (capacity_factor=0)")


def task(config: Any) -> Any:
    from plait.families.gpt.task import LanguageTask

    return LanguageTask(config)


def shape(model: str) -> GPTConfig:
    return get_preset(model)


FAMILY = Family(
    name="gpt", models=f"plait's GPT: {', '.join(TRAINABLE)} (e.g. tiny,n_layers=4; "
                       f"shape-only for plait estimate: {', '.join(p for p in PRESETS if p not in TRAINABLE)})",
    matches=matches, task=task, check=check, resolve=resolve, shape=shape, memory=estimated_memory(shape),
    reads=LANGUAGE_READS)
