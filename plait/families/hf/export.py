"""`plait ckpt export --hf OUT CKPT`: a checkpoint of an hf:DIR run, or the run's own outputs,
as a directory that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads with the
trained weights.

Both hold everything needed (plait.families.hf.task attaches DIR's config.json, and its
generation config and tokenizer files when there were any, to every checkpoint and to the
run's --out), so the export works after DIR has moved or changed, and for a run that saved
no checkpoint. The weights keep transformers' own names: they are stored by the model's
parameter names, whatever the layout that wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.errors import PlaitError
from plait.models.hf.config import CONFIG
from plait.train.checkpoint.read import trained_model
from plait.families.hf.task import ATTACHED


def export_hf(path: str | Path, out: str | Path) -> tuple[Path, int]:
    """Write checkpoint (or run) `path` as a Hugging Face model directory `out`; (out, tensor count)."""
    from plait.models.hf.load import write_hf_dir

    trained = trained_model(path)
    config_file = f"{ATTACHED}/{CONFIG}"
    if config_file not in trained.files:
        raise PlaitError(f"{trained.source} is of --model {trained.model}, not of a Hugging Face model (hf:DIR)",
                         hint=f"export its weights as one safetensors file: plait ckpt export {path} --to FILE.safetensors")
    config = json.loads(trained.files[config_file].read_text())
    extra = {name.removeprefix(f"{ATTACHED}/"): file for name, file in trained.files.items()
             if name.startswith(f"{ATTACHED}/") and name != config_file}  # tokenizer, generation config
    return write_hf_dir(out, config, trained.weights, extra), len(trained.weights)
