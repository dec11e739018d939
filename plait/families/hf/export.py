"""`plait ckpt export --hf OUT CKPT`: a checkpoint of an hf:DIR run, or the run's own outputs,
as a directory that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads with the
trained weights.

Both hold everything needed (plait.families.hf.task attaches DIR's config.json, and its
generation config and tokenizer files when there were any, to every checkpoint and to the
run's --out), so the export works after DIR has moved or changed, and for a run that saved
no checkpoint. The weights keep transformers' own names: they are stored by the model's
parameter names, whatever the layout that wrote them (a tied head once, as `save_pretrained`
does, re-tied by `from_pretrained`), as transformers writes a large model: one
model.safetensors, or above `--max-shard-size` shards with model.safetensors.index.json. They
are read and written a tensor at a time (plait/train/checkpoint/shards.py), so an export
never holds the model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from plait.errors import PlaitError
from plait.models.hf.config import CONFIG, WEIGHTS, WEIGHTS_INDEX
from plait.train.checkpoint.read import trained_model
from plait.train.checkpoint.shards import write_streamed
from plait.families.hf.task import ATTACHED

DEFAULT_MAX_SHARD = 50 * 10**9  # transformers' save_pretrained default, 50GB


def export_hf(path: str | Path, out: str | Path, max_bytes: int = DEFAULT_MAX_SHARD) -> tuple[Path, int]:
    """Write checkpoint (or run) `path` as a Hugging Face model directory `out`; (out, tensor count)."""
    trained = trained_model(path)
    config_file = f"{ATTACHED}/{CONFIG}"
    if config_file not in trained.files:
        raise PlaitError(f"{trained.source} is of --model {trained.model}, not of a Hugging Face model (hf:DIR)",
                         hint=f"export its weights as one safetensors file: plait ckpt export {path} --to FILE.safetensors")
    config = json.loads(trained.files[config_file].read_text())
    extra = {name.removeprefix(f"{ATTACHED}/"): file for name, file in trained.files.items()
             if name.startswith(f"{ATTACHED}/") and name != config_file}  # tokenizer, generation config
    return write_hf_dir(out, config, trained.weights, extra, max_bytes), len(trained.weights)


def _shard_name(name: str) -> bool:
    return name.startswith("model-") and name.endswith(".safetensors")


def write_hf_dir(out: str | Path, config: dict, weights: Mapping[str, torch.Tensor], extra: dict[str, Path],
                 max_bytes: int = DEFAULT_MAX_SHARD) -> Path:
    """DIR for `from_pretrained(DIR)`: config.json, the weights (streamed: shards.py) and the
    `extra` files (generation config, tokenizer) by their names; atomic (temporary directory,
    rename)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PlaitError(f"--hf {out} exists and is not a directory", hint="choose a new directory name")
    # The directory is replaced whole: only an earlier export of these same files may be there.
    ours = {CONFIG, WEIGHTS, WEIGHTS_INDEX, *extra}
    others = sorted(p.name for p in out.iterdir() if p.name not in ours and not _shard_name(p.name)) \
        if out.is_dir() else []
    if others:
        raise PlaitError(f"--hf {out} holds files an export does not write ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}), which replacing it would delete",
                         hint="choose a new directory name, or empty that one first")
    tmp, old = out.with_name(f".{out.name}.tmp-{os.getpid()}"), out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_streamed(tmp, weights, max_bytes)  # metadata format=pt: transformers reads only such files
        for name, path in extra.items():
            shutil.copyfile(path, tmp / name)
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    except OSError as exc:
        raise PlaitError(f"--hf {out} could not be written: {exc.strerror or exc}",
                         hint="choose a directory you can write to, with space for the weights") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out
