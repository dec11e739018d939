"""Which task trains `--model`: one place that knows every family, above all of them (each
task module imports the base it extends, so the choice cannot live beside the base)."""

from __future__ import annotations

from plait.train.config import TrainConfig
from plait.train.task import LanguageTask, Task


def task_for(config: TrainConfig) -> Task:
    """The image task for a ResNet `--model`, a Hugging Face model's for hf:DIR, else plait's GPT."""
    from plait.models.hf_config import is_hf
    from plait.models.resnet_config import is_resnet

    if is_hf(config.model):
        from plait.train.hf_task import HFTask

        return HFTask(config)
    if is_resnet(config.model):
        from plait.train.image_task import ImageTask

        return ImageTask(config)
    return LanguageTask(config)
