"""`--model hf:DIR` checked before any process starts: the directory, its tokenizer, the data.

torch-free (the spawner runs it). The rules, each one PlaitError naming the fix:
- DIR holds config.json of a family plait trains (plait.models.hf_config);
- `--seq-len` fits the model's positions;
- with DIR/tokenizer.json, raw `--data` is tokenized with it, so the tokenizer's vocabulary
  must fit config.json's vocab_size (a model may have more rows than tokens, never fewer);
- without it, raw text is bytes: vocab_size must be at least 256;
- a prepared corpus (`plait data prepare`) must have been tokenized as the model reads
  text: its ids must fit vocab_size, and when DIR has a tokenizer, with that tokenizer.
"""

from __future__ import annotations

from typing import Any

from plait.errors import PlaitError
from plait.models.hf_config import HFModelDir, read_hf_dir


def check_hf_run(config: Any) -> HFModelDir:
    """The model directory of `config.model` (hf:DIR), checked against the other options."""
    hf = read_hf_dir(config.model)
    spec, shape = config.model, hf.shape()
    if config.seq_len > shape.max_seq_len:
        raise PlaitError(f"--seq-len {config.seq_len} is longer than --model {spec} allows ({shape.max_seq_len})",
                         hint=f"use --seq-len {shape.max_seq_len} or less")
    if config.sync_bn:
        raise PlaitError(f"--sync-bn shares BatchNorm statistics, and --model {spec} has no BatchNorm",
                         hint="drop --sync-bn")
    if hf.tokenizer is not None:
        vocab = tokenizer_vocab(hf)
        if vocab > hf.vocab_size:
            raise PlaitError(f"--model {spec}: tokenizer.json has {vocab:,} tokens, more than the vocab_size "
                             f"{hf.vocab_size:,} of config.json", hint="use the tokenizer the model was made for, "
                             f"or set vocab_size to {vocab} or more in config.json")
    _check_data(hf, config.data, spec)
    return hf


def tokenizer_vocab(hf: HFModelDir) -> int:
    """Tokens of DIR/tokenizer.json, added tokens included (their ids are embedded too)."""
    from plait.train.prepare import load_tokenizer

    tokenizer, _ = load_tokenizer(str(hf.tokenizer))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _check_data(hf: HFModelDir, data: str, spec: str) -> None:
    from plait.train.tokens import TOKENIZER, is_prepared, read_index

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
