"""A local Hugging Face directory as a family: `--model hf:DIR`.

DIR holds a causal LM's config.json (any `model_type` transformers builds with
AutoModelForCausalLM), optionally its safetensors weights and tokenizer.json. Nothing is
downloaded. Data and ZeRO take any such model; tensor and pipeline parallelism read the
plans its config declares (plait/models/hf/plans.py) or GPT-2's hand-written adapter.
"""

from __future__ import annotations

from typing import Any

from plait.families.language import LANGUAGE_READS, check_corpus, check_language_run, estimated_memory
from plait.families.record import Family
from plait.models.hf.config import PREFIX, is_hf, read_hf_dir


def check(config: Any) -> None:
    from plait.rules import check_experts_split

    from plait.families.hf.check import check_hf_run

    hf = check_hf_run(config)  # a causal LM's directory, its tokenizer and the data agree
    shape = hf.shape_or_none()
    if shape is None and (config.tp > 1 or config.pp > 1):
        hf.shape()  # raises, naming the sizes its config.json lacks
    if shape is not None:
        check_language_run(config, shape)
        check_experts_split(shape.experts, config.ep)
    elif config.ep > 1:
        hf.shape()  # raises, naming the sizes its config.json lacks
    else:
        check_corpus(config.data)


def task(config: Any) -> Any:
    from plait.families.hf.task import HFTask

    return HFTask(config)


def shape(model: str) -> Any:
    """The estimator's shape: config.json's sizes, and the MLP's matrices counted on the model
    transformers builds from it on the meta device (torch is imported here, not before)."""
    from plait.models.hf.load import measured_shape

    return measured_shape(read_hf_dir(model))


FAMILY = Family(name="hf", models=f"{PREFIX}DIR, a local Hugging Face causal LM (config.json; weights and "
                                  "tokenizer.json optional)",
                matches=is_hf, task=task, check=check, shape=shape, memory=estimated_memory(shape), reads=LANGUAGE_READS)
