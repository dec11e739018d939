"""LanguageTask: next-token prediction with plait's GPT on a corpus (the task seam:
plait.train.loop.task). `HFTask` (plait.families.hf.task) adapts it to a Hugging Face model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.estimate.layout import Workload
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import TEMPERATURE, build_gpt, sample_next
from plait.train.config.settings import TrainConfig
from plait.train.data.blend import language_splits
from plait.train.data.tokens import TextCodec, text_codec
from plait.parallel.packed import IGNORE
from plait.train.loop.task import NextLogits


class LanguageTask:
    """Next-token prediction with plait's GPT on a corpus (bytes, or a prepared token file)."""

    unit = "tokens"
    eval_columns = ("loss", "tokens")
    metric_labels = {"val_loss": ("held-out", ".3f")}

    def __init__(self, config: TrainConfig):
        self.config = config
        self.model_config = get_preset(config.model)
        self.num_params = self.model_config.num_params()

    def build_model(self, seed: int) -> nn.Module:
        return build_gpt(self.model_config, seed)

    def adapter(self, model: nn.Module) -> Any:
        return None  # plait's GPT names its own (GPT.plait_adapter)

    def load(self) -> tuple[Any, Any, int]:
        config = self.config
        return language_splits(config.data, config.seq_len, config.seed, config.packing, config.doc_mask)

    def corpus(self) -> torch.Tensor:
        """`--data` as token ids, whole (what `plait eval` scores)."""
        from plait.train.data.corpus import load_corpus

        return load_corpus(self.config.data)

    def batch(self, split: Any, indices: list[int], step: int) -> tuple[Any, torch.Tensor]:
        return split.batch(indices)

    def loss_fn(self, executor: Any) -> Any:
        return executor.token_loss

    def units_per_sample(self) -> int:
        return self.config.seq_len

    def batch_text(self, global_batch: int) -> str:
        return f"{global_batch} × {self.config.seq_len} tokens"

    def eval_count(self, val: Any) -> int:
        """The first `eval_samples` held-out sequences, the same for every layout."""
        from plait.errors import PlaitError

        if val.num_samples == 0:
            raise PlaitError(f"the held-out split ({len(val)} tokens) has no sequence of "
                             f"{self.config.seq_len} tokens", hint="lower --seq-len, or give a larger --data")
        return min(val.num_samples, self.config.eval_samples)

    def eval_sums(self, outputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        """Per sequence: its summed next-token loss and how many of its targets carry the loss."""
        losses = loss_fn(outputs, targets, reduction="none").view(targets.shape[0], -1).double()
        counts = (targets != IGNORE).sum(dim=1).double()
        return torch.stack([losses.sum(dim=1), counts], dim=1)

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {"val_loss": totals["loss"] / totals["tokens"]}

    def sample(self, next_logits: NextLogits, device: torch.device) -> str:
        """A short continuation of `--prompt`, drawn the same way on every rank."""
        if self.config.sample_tokens == 0:
            return ""
        codec = self.codec()  # bytes, or the tokenizer of the corpus or of the model
        ids = torch.tensor([codec.encode(self.config.prompt)], dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(self.config.seed)
        for _ in range(self.config.sample_tokens):
            logits = next_logits(ids[:, -self.context_length():], self.vocab_size)
            ids = torch.cat((ids, sample_next(logits, TEMPERATURE, generator)), dim=1)
        return codec.decode(ids[0].tolist())

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def context_length(self) -> int:
        """The longest context the model takes (the sample keeps its last tokens)."""
        return self.model_config.max_seq_len

    def prediction(self, work: Workload, hardware: Any) -> dict[str, Any]:
        from plait.estimate import estimate_layout

        return estimate_layout(self.model_config, work, hardware=hardware)

    def calibration_shape(self) -> tuple[Any, int] | None:
        """The shape the calibration times GEMMs at: this model's, at the run's sequence length."""
        return (self.model_config, self.config.seq_len) if self.model_config is not None else None

    def codec(self) -> TextCodec:
        """Text <-> ids for the prompt and the sample: bytes, or the prepared corpus's tokenizer."""
        return text_codec(self.config.data)

    def attachments(self) -> dict[str, Path]:
        """Files a checkpoint carries beside the tensors (a Hugging Face model's config): none."""
        return {}
