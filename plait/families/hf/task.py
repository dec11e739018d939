"""Language modelling with a Hugging Face model (`--model hf:DIR`): LanguageTask, adapted.

What differs from plait's GPT, and nothing else:
- the model is DIR's transformers model (plait.models.hf.load), from its weights or the seed;
- text is tokenized with DIR/tokenizer.json when there is one (raw `--data` here, on every
  rank, the same way `plait data prepare --tokenizer DIR` would), else read as bytes;
- the model returns an output object: the loss reads its `.logits` (one place, `logits_of`),
  so the trainer's loop, evaluation and the pipeline runner need no change;
- the model's adapter (what tensor and pipeline parallelism ask of it) is read from the
  plans its config declares (plait.models.adapters);
- checkpoints carry DIR's config.json (and its generation config and tokenizer files), so that
  `plait ckpt export --hf` can write a directory transformers loads, from the checkpoint alone.

The model's shape for estimates and the report is read from config.json (hf_config.shape);
its exact parameter count is the built model's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.errors import PlaitError
from plait.estimate.layout import Workload
from plait.models.hf.config import COMPANIONS, CONFIG, TOKENIZER, read_hf_dir
from plait.models.hf.load import measured_shape
from plait.train.config.settings import TrainConfig
from plait.train.data.blend import language_splits
from plait.train.data.corpus import corpus_digest, load_corpus, train_val_split
from plait.train.data.packing import packing_for
from plait.parallel.seam import logits_of
from plait.families.gpt.task import LanguageTask
from plait.train.data.tokens import TextCodec, blend_parts, is_prepared, text_codec

log = logging.getLogger(__name__)
ATTACHED = "hf"  # the checkpoint's folder for the model directory's files


class HFTask(LanguageTask):
    """Next-token prediction with a local Hugging Face model."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.hf = read_hf_dir(config.model)
        # None: a decoder whose sizes plait cannot read; else the shape of the model itself (its
        # MLP's matrices). What autograd keeps of its blocks, which only the prediction reads, is
        # measured when that is asked (`prediction`: forwards, seconds for a large model), not on
        # every rank's start and restart
        self.model_config = measured_shape(self.hf, kept=False) if self.hf.shape_or_none() is not None else None
        self._kept_measured = False
        self.num_params = self.model_config.num_params() if self.model_config else 0  # exact once built
        self._tokenizer: Any = None
        # Built on the meta device, each rank filling its share (plait.parallel.deferred): from
        # the seed, or reading its slices of the safetensors files (`weights`).
        self.meta_build = True

    def build_model(self, seed: int) -> nn.Module:
        from plait.models.hf.experts import install_routing_stats, routed_experts
        from plait.models.hf.load import build_hf_model
        from plait.models.hf.plans import declared

        model = build_hf_model(self.hf, seed)
        # a mixture of experts: its routing is counted for the report
        experts, why = routed_experts(model, declared(model, "ep"))
        if why is not None and self.config.ep > 1:
            raise why
        if why is not None:  # a plan is refused only where the run uses it: without ep, only the counts are lost
            log.info("the experts' routing is not counted for the report: %s", why.message)
        install_routing_stats(model, experts)
        self.num_params = sum(p.numel() for p in model.parameters())  # a tied head counted once
        return model

    def weights(self, model: nn.Module, seed: Any) -> Any:
        """Where the meta-built `model`'s tensors come from: DIR's safetensors files (each rank
        reading its slices; the seed for what they lack), or the seed alone."""
        if not self.hf.weights:
            return seed
        from plait.models.hf.weights import SafetensorsWeights

        return SafetensorsWeights(self.hf, model, seed)

    def adapter(self, model: nn.Module) -> Any:
        from plait.models.adapters import adapter_for

        return adapter_for(model)

    def tokenizer(self) -> Any:
        if self._tokenizer is None and self.hf.tokenizer is not None:
            from plait.train.data.prepare import load_tokenizer

            self._tokenizer, _ = load_tokenizer(str(self.hf.tokenizer))
        return self._tokenizer

    def load(self) -> tuple[Any, Any, int]:
        config = self.config
        if blend_parts(config.data):  # its parts are prepared corpora (plait.families.hf.check)
            return language_splits(config.data, config.seq_len, config.seed, config.packing, config.doc_mask)
        tokens = self.corpus()
        packing = packing_for(tokens, config.packing, config.doc_mask)
        return (*train_val_split(tokens, config.seq_len, seed=config.seed, packing=packing), corpus_digest(tokens))

    def corpus(self) -> torch.Tensor:
        """`--data` as the model's token ids, whole (what `plait eval` scores)."""
        tokens = load_corpus(self.config.data)
        if self.hf.tokenizer is not None and not is_prepared(self.config.data):
            tokens = self._encode(tokens)
        return tokens

    def _encode(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw text's bytes -> the tokenizer's ids, in chunks ending at line breaks."""
        from plait.train.data.prepare import encode_texts, text_chunks

        text = bytes(raw.numpy()).decode("utf-8", errors="replace")
        ids = list(encode_texts(self.tokenizer(), text_chunks(text)))
        return torch.from_numpy(np.concatenate(ids).astype(np.int64)) if ids else torch.zeros(0, dtype=torch.int64)

    def loss_fn(self, executor: Any) -> Any:
        """Cross-entropy on the output's logits. Under tensor parallelism they may be this
        rank's slice of the vocabulary (plait's vocabulary-parallel loss) or, gathered for
        the user's code, the whole of it (the plain loss): their width says which."""
        def loss(outputs: Any, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
            logits = logits_of(outputs)
            return executor.token_loss(logits, targets, reduction, sliced=logits.shape[-1] != self.hf.vocab_size)

        return loss

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    def context_length(self) -> int:
        return self.hf.size("positions") or self.config.seq_len

    def prediction(self, work: Workload, hardware: Any) -> dict[str, Any]:
        """The estimate of its shape, or (a config that names no sizes) of its parameter count."""
        if self.model_config is not None:
            if not self._kept_measured:
                self.model_config, self._kept_measured = measured_shape(self.hf), True
            return super().prediction(work, hardware)
        from plait.estimate import estimate_by_size

        return estimate_by_size(self.num_params, work, hardware=hardware)

    def explain_failure(self, exc: BaseException) -> PlaitError | None:
        """A failed first step as the input's fault, where it is: the model's own forward, at one
        process, fails with the same line (plait.models.hf.load.fails_on_its_own), so no layout
        or flag of plait's would mend it; None leaves the failure as it was raised."""
        from plait.models.hf.load import fails_on_its_own

        line = fails_on_its_own(self.hf, exc, self.config.micro_batch, self.config.seq_len)
        if line is None:
            return None
        return PlaitError(f"--model hf:{self.hf.path}: the model's own forward fails at one process, before "
                          f"plait splits anything: {line}",
                          hint="its config.json's sizes disagree with each other (transformers builds the model "
                               "but cannot run it): check that it runs alone with transformers; --debug shows "
                               "the traceback")

    def codec(self) -> TextCodec:
        tokenizer = self.tokenizer()
        return TextCodec(tokenizer) if tokenizer is not None else text_codec(self.config.data)

    def attachments(self) -> dict[str, Path]:
        """The files a checkpoint carries: DIR's config.json and its companions when present,
        and the run's tokenizer.json (DIR's, else the prepared corpus's)."""
        files = {f"{ATTACHED}/{CONFIG}": self.hf.path / CONFIG}
        tokenizer = self.hf.tokenizer or (Path(self.config.data) / TOKENIZER if is_prepared(self.config.data) else None)
        for name, path in [*((n, self.hf.path / n) for n in COMPANIONS), (TOKENIZER, tokenizer)]:
            if path is not None and path.is_file():
                files[f"{ATTACHED}/{name}"] = path
        return files
