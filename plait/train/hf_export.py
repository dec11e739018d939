"""`plait ckpt export --hf OUT CKPT`: a checkpoint of an hf:DIR run as a directory that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads with the trained weights.

The checkpoint holds everything needed (plait.train.hf_task attaches DIR's config.json, and
its generation config and tokenizer files when there were any), so the export works after
DIR has moved or changed. The weights keep transformers' own names: checkpoints store them
by the model's parameter names, whatever the layout that wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.errors import PlaitError
from plait.models.hf_config import CONFIG
from plait.train.checkpoint_read import Reader, model_weights
from plait.train.hf_task import ATTACHED


def export_hf(path: str | Path, out: str | Path) -> tuple[Path, int]:
    """Write checkpoint `path` as a Hugging Face model directory `out`; (out, tensor count)."""
    from plait.models.hf_load import write_hf_dir

    reader = Reader(path)
    config_file = f"{ATTACHED}/{CONFIG}"
    if config_file not in reader.index["files"]:
        model = reader.index.get("trainer", {}).get("config", {}).get("model", "plait's GPT")
        raise PlaitError(f"checkpoint {reader.path} is of --model {model}, not of a Hugging Face model (hf:DIR)",
                         hint=f"export its weights as one safetensors file: plait ckpt export {path} --to FILE.safetensors")
    config = json.loads((reader.path / config_file).read_text())
    weights = model_weights(reader)
    extra = {name.removeprefix(f"{ATTACHED}/"): reader.path / name for name in reader.index["files"]
             if name.startswith(f"{ATTACHED}/") and name != config_file}  # tokenizer, generation config
    return write_hf_dir(out, config, weights, extra), len(weights)
