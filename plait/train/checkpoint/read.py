"""Reading checkpoints: find, verify, and assemble any block of any tensor from its pieces.

Every failure names the file or the tensor at fault: a missing directory, an incomplete
checkpoint, a truncated or altered file (size and sha256 are checked before anything is
read), a tensor the checkpoint lacks, or one of another shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.runtime import comm
from plait.runtime.mesh import Mesh
from plait.parallel.pieces import Piece, local_pieces
from plait.train.checkpoint.shards import LazyWeights, has_weights, open_safetensors, read_weights, write_streamed
from plait.train.checkpoint.write import FORMAT, init_optimizer_state, sha256
from plait.train.checkpoint.restart import read_index, resolve  # torch-free, also read before spawning


class Reader:
    """An opened, verified checkpoint."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = resolve(path)
        self.index = read_index(self.path)
        if self.index.get("format") != FORMAT:
            raise PlaitError(f"{self.path / 'index.json'} is not a {FORMAT} checkpoint")
        if verify:
            self.verify()

    def verify(self, names: list[str] | None = None) -> None:
        """Every file (or those named) present, of the recorded size and sha256."""
        for name in self.index["files"] if names is None else names:
            info, file = self.index["files"][name], self.path / name
            if not file.exists():
                raise PlaitError(f"checkpoint file {file} is missing", hint="the checkpoint is damaged; use an older one")
            if file.stat().st_size != info["bytes"]:
                raise PlaitError(f"checkpoint file {file} is truncated: {file.stat().st_size} bytes, "
                                 f"expected {info['bytes']}", hint="the checkpoint is damaged; use an older one")
            if sha256(file) != info["sha256"]:
                raise PlaitError(f"checkpoint file {file} fails its sha256 check",
                                 hint="the file changed after it was written; use an older checkpoint")

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.index["tensors"]

    def read_block(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...],
                   full_shape: tuple[int, ...]) -> torch.Tensor:
        """The block [offsets, offsets + shape) of tensor `name`, assembled from its pieces."""
        entry = self.tensors.get(name)
        if entry is None:
            hint = ("it was written without fp32 master weights (an fp32 run); resume it with --precision fp32"
                    if name.endswith("/master") else "it was written by another model; check --model")
            raise PlaitError(f"checkpoint {self.path} has no tensor {name!r}", hint=hint)
        if tuple(entry["shape"]) != tuple(full_shape):
            raise PlaitError(f"tensor {name!r} in {self.path} has shape {tuple(entry['shape'])}, "
                             f"this model needs {tuple(full_shape)}", hint="it was written by another model; check --model")
        out = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            covered += self._copy_overlap(piece, out, offsets)
        if covered != out.numel():
            raise PlaitError(f"checkpoint {self.path} does not cover all of tensor {name!r}")
        return out

    def _copy_overlap(self, piece: dict[str, Any], out: torch.Tensor, offsets: tuple[int, ...]) -> int:
        lo = [max(a, b) for a, b in zip(piece["offsets"], offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(piece["offsets"], piece["lengths"], offsets, out.shape)]
        if any(h <= low for low, h in zip(lo, hi)) and out.ndim:
            return 0
        src = tuple(slice(low - p, h - p) for low, h, p in zip(lo, hi, piece["offsets"]))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))
        with self._file(piece["file"]) as handle:
            block = handle.get_slice(piece["key"])[src] if out.ndim else handle.get_tensor(piece["key"])
        out[dst] = block
        return block.numel()

    def _file(self, name: str) -> Any:
        """One of the checkpoint's files, opened for one read and closed after it: the pages a
        read touches of a mapped file stay in the process's resident memory while it is open,
        so a resume that kept every file open would end holding every page it read."""
        return open_safetensors(self.path / name)

    def rng_state(self, rank: int) -> torch.Tensor | None:
        file = f"rank{rank:05d}.safetensors"
        if file not in self.index["files"]:
            return None
        with self._file(file) as handle:
            return handle.get_tensor(f"rng/rank{rank}")

    def full(self, name: str) -> torch.Tensor:
        shape = tuple(self.tensors[name]["shape"])
        return self.read_block(name, (0,) * len(shape), shape, shape)


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict[str, Any]:
    """Fill this rank's model and optimizer from a checkpoint of any layout; returns the trainer state."""
    reader = Reader(path, verify=False)
    verify_shared(reader, mesh)
    init_optimizer_state(model, optimizer)
    loaded, refusal = set(), None
    for piece in local_pieces(model, optimizer, mesh):
        if piece.buffer and piece.name not in reader.tensors:
            continue  # written before checkpoints held buffers: the model keeps its own
        loaded.add(piece.name)
        try:
            block = reader.read_block(_source(reader, piece.name), piece.offsets, tuple(piece.tensor.shape),
                                      piece.full_shape)
        except PlaitError as exc:  # another model's checkpoint: said once every rank knows (check_fits)
            refusal = refusal or exc
            continue
        with torch.no_grad():
            piece.tensor.copy_(block.to(piece.tensor.device, piece.tensor.dtype))
    check_fits(reader, loaded, refusal, mesh)
    if reader.index["world_size"] == mesh.env.world_size:
        state = reader.rng_state(mesh.global_rank)
        if state is not None:
            torch.set_rng_state(state)
    return {**reader.index["trainer"], "step": reader.index["step"], "path": str(reader.path)}


def check_fits(reader: Reader, loaded: set[str], refusal: PlaitError | None, mesh: Mesh) -> None:
    """The checkpoint and the model fit each other, agreed by every rank in one all-reduce (a
    flag per model tensor of the checkpoint, and one for a rank that could not load): no
    tensor this model needs is missing or of another shape (a smaller model's checkpoint; only
    the ranks needing it knew), and every model tensor of the checkpoint went into some rank's
    model (a larger model's checkpoint in fewer layers would drop the rest without a word).
    Every rank raises alike, none is left waiting in the next collective."""
    names = sorted(name for name in reader.tensors if name.startswith("model/"))
    flags = torch.tensor([name in loaded for name in names] + [refusal is not None], dtype=torch.int32,
                         device=mesh.device)
    comm.all_reduce(flags, mesh.axis("world"), op="max", purpose=comm.SETUP)
    *used, refused = flags.tolist()
    if refusal is not None:
        raise refusal
    if refused:
        raise PlaitError(f"checkpoint {reader.path} does not fit this model: another rank's error names the tensor",
                         hint="it was written by another model; check --model")
    unused = [name.removeprefix("model/") for name, flag in zip(names, used) if not flag]
    if unused:
        raise PlaitError(f"checkpoint {reader.path} holds {len(unused)} tensor(s) this model has no place for, e.g. "
                         f"{unused[0]}: it was written by another model", hint="resume with the model that wrote it")


def _source(reader: Reader, name: str) -> str:
    """The checkpoint tensor to fill `name` from: itself, or for an fp32 master that an fp32 run
    did not write (its weights were the masters), the fp32 weights themselves."""
    prefix, _, rest = name.partition("/")
    if prefix == "optim" and rest.endswith("/master") and name not in reader.tensors:
        weights = f"model/{rest.removesuffix('/master')}"
        if reader.tensors.get(weights, {}).get("dtype") == "float32":
            return weights
    return name


def verify_shared(reader: Reader, mesh: Mesh) -> None:
    """Verify the checkpoint's files once between all ranks, not once on each.

    Rank r hashes files r, r + world, ...; the ranks then agree on the first bad file
    (one all-reduce), and every rank raises an error naming it. With replicated state
    every rank reads every file, and hashing each eight times on eight ranks would cost
    more than the reading. Any failure (a bad file, or one this rank cannot read) is
    recorded rather than raised on the spot, so that no rank leaves the others waiting.
    """
    files = sorted(reader.index["files"])
    world = mesh.axis("world")
    first_bad = torch.tensor([len(files)], dtype=torch.int64, device=mesh.device)
    for i in range(world.rank, len(files), world.size):
        try:
            reader.verify([files[i]])
        except Exception:  # noqa: BLE001 - reported below, on every rank
            first_bad[0] = i
            break
    comm.all_reduce(first_bad, world, op="min", purpose=comm.SETUP)
    if first_bad.item() < len(files):
        file = reader.path / files[first_bad.item()]
        try:
            reader.verify([files[first_bad.item()]])
        except PlaitError:
            raise
        except OSError as exc:
            raise PlaitError(f"checkpoint file {file} cannot be read: {exc}",
                             hint="check the file's permissions and the file system") from None
        raise PlaitError(f"checkpoint file {file} failed verification on another rank",
                         hint="check that every node sees the same checkpoint directory")


def describe(path: str | Path) -> str:
    """What `plait ckpt inspect` prints."""
    reader = Reader(path)
    index = reader.index
    layout = _layout_text(index["layout"])
    total = sum(f["bytes"] for f in index["files"].values())
    lines = [f"checkpoint {reader.path}", f"  step {index['step']}, written by {index['world_size']} rank(s): {layout}",
             f"  {len(index['files'])} file(s), {total:,} bytes, sha256 verified", "  tensors:"]
    for name, entry in sorted(index["tensors"].items()):
        shape = "×".join(map(str, entry["shape"])) or "scalar"
        lines.append(f"    {name:<48} {shape:<14} {entry['dtype']:<9} {len(entry['pieces'])} piece(s)")
    return "\n".join(lines)


def _layout_text(layout: dict[str, Any]) -> str:
    """The layout that wrote a checkpoint, as plait.layout describes it (older ones: its degrees)."""
    from plait.layout import Layout

    try:
        return Layout(**layout).describe()
    except (TypeError, PlaitError):
        return " ".join(f"{k}={v}" for k, v in layout.items())


def export(path: str | Path, to: str | Path) -> int:
    """Write the model's tensors, whole, to one plain safetensors file, a tensor at a time
    (written under a temporary name, then renamed); returns the tensor count."""
    to = Path(to)
    if to.is_dir():
        raise PlaitError(f"--to {to} is a directory", hint=f"give a file name, e.g. {to / 'model.safetensors'}")
    trained = trained_model(path)
    if not to.parent.is_dir():
        raise PlaitError(f"--to {to} could not be written: {to.parent} is not a directory",
                         hint="choose a file in a directory you can write to")
    try:
        write_streamed(to.parent, trained.weights, max_bytes=2**63, single=to.name, replaces=False,
                       metadata={"step": str(trained.step), "source": str(trained.source)})
    except OSError as exc:
        raise PlaitError(f"--to {to} could not be written: {exc.strerror or exc}",
                         hint="choose a file in a directory you can write to") from None
    return len(trained.weights)


def model_weights(reader: Reader) -> LazyWeights:
    """{parameter name: whole tensor} of the model in a checkpoint (its optimizer state left
    out), each assembled from its pieces only when asked."""
    shapes = {name.removeprefix("model/"): (tuple(entry["shape"]), getattr(torch, entry["dtype"]))
              for name, entry in reader.tensors.items() if name.startswith("model/")}
    return LazyWeights(shapes, lambda name: reader.full(f"model/{name}"))


# What a finished run leaves in its --out (plait/train/loop/run.py writes them): the weights, and
# the task's attached files (a Hugging Face model's config.json, its tokenizer) in a folder.
RUN_WEIGHTS, RUN_ATTACHED = "model.safetensors", "attached"


@dataclass(frozen=True)
class TrainedModel:
    """A model to export: whole weights by parameter name, and the files that came with them."""

    weights: Mapping[str, torch.Tensor]  # read a tensor at a time (LazyWeights)
    files: dict[str, Path]  # name as the task attached it ("hf/config.json") -> where it is now
    step: int | str
    source: Path
    model: str  # the --model that trained it


def trained_model(path: str | Path) -> TrainedModel:
    """The model at `path`: a checkpoint (or a run's latest one), else a finished run's own
    outputs (OUT/model.safetensors, OUT/attached/), so that a run without --save-every can
    still be exported."""
    run = Path(path)
    try:
        reader = Reader(path)
    except PlaitError:
        if not has_weights(run):
            raise
        return _from_outputs(run)
    files = {name: reader.path / name for name in reader.index["files"] if "/" in name}
    model = reader.index.get("trainer", {}).get("config", {}).get("model", "?")
    return TrainedModel(model_weights(reader), files, reader.index["step"], reader.path, model)


def _from_outputs(run: Path) -> TrainedModel:
    attached = run / RUN_ATTACHED
    files = {str(f.relative_to(attached)): f for f in sorted(attached.rglob("*")) if f.is_file()}
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    return TrainedModel(read_weights(run), files, summary.get("steps", "final"), run, summary.get("model", "?"))


__all__ = ["Piece", "Reader", "TrainedModel", "describe", "export", "load", "model_weights", "trained_model"]
