"""`--model hf:DIR` checked before any process starts: the directory, its tokenizer, the data.

torch-free (the spawner runs it). The rules, each one PlaitError naming the fix:
- DIR holds the config.json of a causal LM transformers builds (plait.models.hf.config);
  `--seq-len` and the layout
  against its shape are every language model's checks (plait.families.language);
- with DIR/tokenizer.json, raw `--data` is tokenized with it, so the tokenizer's vocabulary
  must fit config.json's vocab_size (a model may have more rows than tokens, never fewer);
- without it, raw text is bytes: vocab_size must be at least 256;
- a prepared corpus (`plait data prepare`) must have been tokenized as the model reads
  text: its ids must fit vocab_size, and when DIR has a tokenizer, with that tokenizer;
- dropout and router noise train only in one process (`check_random_draws`).
"""

from __future__ import annotations

from typing import Any

from plait.errors import PlaitError
from plait.models.hf.config import HFModelDir, random_draws, read_hf_dir


def check_hf_run(config: Any) -> HFModelDir:
    """The model directory of `config.model` (hf:DIR), checked against the other options."""
    hf = read_hf_dir(config.model)
    spec = config.model
    check_causal_lm(hf, spec)
    if hf.tokenizer is not None:
        vocab = tokenizer_vocab(hf)
        if vocab > hf.vocab_size:
            raise PlaitError(f"--model {spec}: tokenizer.json has {vocab:,} tokens, more than the vocab_size "
                             f"{hf.vocab_size:,} of config.json", hint="use the tokenizer the model was made for, "
                             f"or set vocab_size to {vocab} or more in config.json")
    _check_data(hf, config.data, spec)
    check_random_draws(hf, config.layout.world, spec)
    return hf


def check_random_draws(hf: HFModelDir, world: int, spec: str) -> None:
    """Dropout masks and router noise are drawn from each rank's generator, seeded alike: dp
    ranks draw the same masks for different samples, tp and cp ranks masks for their own
    shards, so no layout of more than one process trains the one-process model. Refused
    there (the split probe cannot see it: it runs the model in eval mode)."""
    draws = random_draws(hf.config)
    if world > 1 and draws:
        fields = ", ".join(f"{field} = {rate:g}" for field, rate in draws)
        raise PlaitError(f"--model {spec}: {fields}; random draws in the training forward (dropout, router noise) "
                         f"are drawn alike on every rank, so {world} processes would not train the one-process model",
                         hint=f"set them to 0 in {hf.path / 'config.json'}, or train on one process (--nproc 1)")


def check_causal_lm(hf: HFModelDir, spec: str) -> None:
    """DIR's model_type must be one transformers builds as a causal LM (AutoModelForCausalLM)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    except ImportError:
        raise PlaitError(f"--model {spec} needs the `transformers` library", hint="pip install 'plait[hf]'") from None
    if hf.model_type not in CAUSAL:
        raise PlaitError(f"--model {spec}: model_type {hf.model_type!r} in {hf.path / 'config.json'} is not a causal "
                         "language model transformers builds (AutoModelForCausalLM)",
                         hint="plait trains next-token prediction: give a decoder's directory (llama, qwen3, "
                              "mistral, gpt2...)")


def tokenizer_vocab(hf: HFModelDir) -> int:
    """Tokens of DIR/tokenizer.json, added tokens included (their ids are embedded too)."""
    from plait.train.data.prepare import load_tokenizer

    tokenizer, _ = load_tokenizer(str(hf.tokenizer))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _check_data(hf: HFModelDir, data: str, spec: str) -> None:
    from plait.train.data.tokens import TOKENIZER, blend_parts, is_prepared, lead_source, read_index

    parts = blend_parts(data)
    if parts and hf.tokenizer is not None and not all(is_prepared(p.source) for p in parts):
        raw = next(p.source for p in parts if not is_prepared(p.source))
        raise PlaitError(f"--data blends {raw}, raw text, and --model {spec} reads its tokenizer's ids",
                         hint=f"prepare it first: plait data prepare --tokenizer {hf.path} --data {raw} --out DIR")
    data = lead_source(data)  # a blend's parts share their tokens (plait.families.language.check_corpus)
    if not is_prepared(data):
        if hf.tokenizer is None and hf.vocab_size < 256:
            raise PlaitError(f"--model {spec} has no tokenizer.json, so --data is read as bytes (256 ids), and "
                             f"its vocab_size is {hf.vocab_size}",
                             hint="put the model's tokenizer.json in the directory, or set vocab_size ≥ 256")
        return
    index = read_index(data)
    prepare_hint = f"prepare it again: plait data prepare --tokenizer {hf.path} --data SOURCE --out {data}"
    if index.vocab_size > hf.vocab_size:
        raise PlaitError(f"--data {data} has token ids up to {index.vocab_size - 1:,}, more than --model {spec} "
                         f"embeds (vocab_size {hf.vocab_size:,})", hint=prepare_hint)
    if hf.tokenizer is not None:
        prepared = data.rstrip("/") + "/" + TOKENIZER
        try:
            same = open(prepared, "rb").read() == hf.tokenizer.read_bytes()
        except OSError:
            same = False  # prepared as bytes (no tokenizer.json beside its tokens)
        if not same:
            raise PlaitError(f"--data {data} was not tokenized with {hf.tokenizer}", hint=prepare_hint)
