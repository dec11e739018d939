"""Layout-free, atomic checkpoints: every logical tensor stored once, by its full shape.

A checkpoint is a directory:

    step-00000010/
      index.json              every tensor's full shape and dtype, where each piece of it lives,
                              a sha256 per file, the layout that wrote it, the trainer's state
      rank00000.safetensors   the pieces rank 0 owned (plus its RNG state)
      rank00001.safetensors   ...
      hf/config.json          files attached by the task (an hf:DIR model's config and tokenizer),
                              listed and hashed in index.json like the rank files

A piece is a rectangular block of a logical tensor: its offsets and lengths per dimension.
Replicated tensors are written once (by dp rank 0); sharded strategies describe their
shards as pieces. Loading assembles whatever block the *current* layout needs from the
pieces that overlap it, so a checkpoint written with one layout loads into another.

Writes go to `.tmp-step-N/`, are fsynced, then renamed; `latest` moves only after that, so
a crash mid-save leaves the previous checkpoint whole. A write that fails (disk full,
permission lost) on any rank makes every rank raise the same PlaitError, naming the ranks
and the reason, and saying that the previous checkpoint is intact. Nothing is unpickled: JSON and
safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.pieces import Piece, local_pieces
from plait.runtime import comm, inject
from plait.runtime.mesh import Mesh

FORMAT = "plait-checkpoint/1"


def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (before loading into them) with a zero-lr step."""
    if optimizer.state:
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr
    optimizer.zero_grad()


# -- saving ------------------------------------------------------------------------------------
def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh,
         trainer_state: dict[str, Any], keep: int = 3, only: str = "", attach: dict[str, Path] | None = None) -> Path:
    """Write checkpoint `root/step-<step>` from every rank; returns its path.

    `only` keeps the tensors whose names start with it ("model/": the weights alone).
    `attach` {name in the checkpoint: file} are copied in by the main rank and verified like
    the rest (a Hugging Face model's config.json and tokenizer, for `ckpt export --hf`)."""
    pending = _begin(root, step, model, optimizer, mesh, trainer_state, keep, only, attach)
    pending.write()
    return pending.publish()


class AsyncSaves:
    """--async-save: a background thread copies this rank's pieces to host memory while the
    next step's forward and backward run (they read the weights, nothing changes them), and
    then writes them while training goes on; that step's optimizer update first waits for the
    copy (`before_update`).

    The collectives stay on the training thread, at step boundaries: `poll` (after each
    step) learns whether any rank's write is still running, and once none is, the main rank
    writes the index and moves `latest`, as a synchronous save does. So atomicity, checksums, `latest` and the retention are the same; a crash during the
    background write leaves the previous checkpoint whole; a second save first finishes the
    first (`wait`), and so does the end of the run. The copy costs host memory: this rank's
    share of the model and optimizer, once more, until the write ends.
    """

    def __init__(self) -> None:
        self.pending: _PendingSave | None = None
        self.pruning: threading.Thread | None = None

    def save(self, root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh,
             trainer_state: dict[str, Any], keep: int = 3, attach: dict[str, Path] | None = None) -> Path:
        """Start writing `root/step-<step>`; returns the path it will have once published."""
        self.finish()
        pending = _begin(root, step, model, optimizer, mesh, trainer_state, keep, "", attach)
        pending.start()
        self.pending = pending
        return pending.final

    def before_update(self) -> None:
        """Called before the optimizer changes the weights: the pending save's copy is done."""
        if self.pending is not None:
            self.pending.copied.wait()

    def writing(self) -> bool:
        """Whether this rank's background write is still running."""
        return self.pending is not None and self.pending.running()

    def poll(self, any_writing: bool) -> Path | None:
        """Publish the pending save unless some rank is still writing its part: `any_writing`,
        which every rank agreed on (the trainer folds `writing()` into the one all-reduce it
        makes after every step). Collective when it publishes. Returns the published path."""
        if self.pending is None or any_writing:
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Let the pending save's write finish, then publish it (collective); the checkpoints
        past --keep-checkpoints are deleted by a thread of the main rank. Returns its path."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.join()
        self.finish_pruning()
        path = pending.publish(prune=False)
        if pending.mesh.is_main:
            self.pruning = threading.Thread(target=_prune, args=(pending.root, pending.keep), name="plait-prune")
            self.pruning.start()
        return path

    def finish(self) -> Path | None:
        """Every write published and every old checkpoint deleted: the end of a run."""
        path = self.wait()
        self.finish_pruning()
        return path

    def finish_pruning(self) -> None:
        if self.pruning is not None:
            self.pruning.join()
            self.pruning = None


@dataclass
class _PendingSave:
    """One checkpoint between its step boundary and its publication."""

    root: Path
    step: int
    mesh: Mesh
    pieces: list[Piece]
    rng: torch.Tensor
    trainer_state: dict[str, Any]
    keep: int
    attach: dict[str, Path]
    failure: OSError | None = None
    thread: threading.Thread | None = None
    copied: threading.Event = field(default_factory=threading.Event)

    @property
    def final(self) -> Path:
        return self.root / f"step-{self.step:08d}"

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp-step-{self.step:08d}"

    def write(self, copy: bool = False) -> None:
        """This rank's file (from host copies of its pieces, with `copy`); a failure is kept
        for `publish` to agree on, not raised."""
        tensors, records = _host_tensors(self.mesh.global_rank, self.rng, self.pieces, copy)
        self.pieces = []
        self.copied.set()
        self.failure = _attempt(lambda: _write_rank_file(self.tmp, self.mesh.global_rank, self.step, tensors, records))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._write_in_background, name=f"plait-save-{self.step}")
        self.thread.start()

    def _write_in_background(self) -> None:
        _lower_priority()
        try:
            self.write(copy=True)
        finally:
            self.copied.set()  # never leave the training thread waiting

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def publish(self, prune: bool = True) -> Path:
        """Every rank agrees its file is written; the main rank writes the index and moves
        `latest` (and with `prune`, deletes the checkpoints past `keep`); every rank learns
        that it did (or the same error on all of them)."""
        _agree(self.mesh, self.failure, self.final, self.tmp)
        failure = None
        if self.mesh.is_main:
            failure = _attempt(lambda: (_write_index(self.tmp, self.mesh, self.trainer_state, self.step,
                                                     _attach(self.tmp, self.attach)),
                                        _publish(self.root, self.tmp, self.final)))
            if failure is None and prune:
                _prune(self.root, self.keep)
        _agree(self.mesh, failure, self.final, self.tmp)  # also the closing barrier
        return self.final


def _begin(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh,
           trainer_state: dict[str, Any], keep: int, only: str, attach: dict[str, Path] | None) -> _PendingSave:
    """The step boundary's part of a save: a fresh temporary directory (all ranks agree it
    exists), this rank's pieces and its RNG state as it is now."""
    pieces = [p for p in local_pieces(model, optimizer, mesh) if p.name.startswith(only)]
    pending = _PendingSave(root, step, mesh, pieces, torch.get_rng_state(), trainer_state, keep, attach or {})
    failure = _attempt(lambda: _fresh_dir(pending.tmp)) if mesh.is_main else None
    _agree(mesh, failure, pending.final, pending.tmp)
    return pending


def _lower_priority() -> None:
    """The background write takes only the cycles training leaves idle: Linux's SCHED_IDLE
    for this thread (by its id), else a high niceness; elsewhere nothing changes."""
    thread_id = threading.get_native_id()
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, 19)
    except (AttributeError, OSError):
        pass


def _fresh_dir(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _attempt(write: Any) -> OSError | None:
    """Run one write; a full disk or a lost permission comes back as the OSError, not raised."""
    try:
        write()
    except OSError as exc:
        return exc
    return None


def _agree(mesh: Mesh, failure: OSError | None, final: Path, tmp: Path) -> None:
    """Every rank learns whether any rank's write failed, and then all raise the same error.

    A rank that raised alone would leave the others waiting in the next barrier until the
    timeout; `latest` has not moved, so the previous checkpoint stays whole and loadable."""
    flags = torch.zeros(mesh.env.world_size, dtype=torch.int32, device=mesh.device)
    flags[mesh.global_rank] = failure is not None
    comm.all_reduce(flags, mesh.axis("world"), purpose=comm.TELEMETRY)
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    if mesh.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = final.parent / "latest"
    kept = f"the previous checkpoint {latest.resolve().name} is intact" if latest.exists() else "no earlier checkpoint exists"
    reason = f": {failure.strerror or failure}" + (f" ({failure.filename})" if failure.filename else "") if failure else ""
    raise PlaitError(f"checkpoint {final} could not be written on rank(s) {', '.join(map(str, failed))}{reason}; "
                     f"{kept}", hint="free disk space or fix the permissions of --out, then continue with --resume auto")


def _host_tensors(rank: int, rng: torch.Tensor, pieces: list[Piece], copy: bool
                  ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The tensors of this rank's file (its owned pieces and its RNG state) and their records
    (`copy`: host copies that later steps cannot change, for a write that runs beside them)."""
    tensors: dict[str, torch.Tensor] = {f"rng/rank{rank}": rng}
    records = []
    for piece in pieces:
        if not piece.owned:
            continue
        # A rank may hold several blocks of one tensor (a ZeRO shard can end mid-row).
        key = f"{piece.name}@{rank}@{','.join(map(str, piece.offsets))}"
        tensors[key] = piece.tensor.detach().to("cpu", copy=copy).contiguous()
        records.append({"name": piece.name, "key": key, "offsets": list(piece.offsets),
                        "lengths": list(piece.tensor.shape), "full_shape": list(piece.full_shape),
                        "dtype": str(piece.tensor.dtype).removeprefix("torch.")})
    return tensors, records


def _write_rank_file(tmp: Path, rank: int, step: int, tensors: dict[str, torch.Tensor],
                     records: list[dict[str, Any]]) -> None:
    from safetensors.torch import save_file

    path = tmp / f"rank{rank:05d}.safetensors"
    save_file(tensors, str(path))
    _fsync(path)
    inject.maybe_inject(rank, step, phase="save")  # rehearsals: a rank dying mid-save
    meta = {"file": path.name, "sha256": sha256(path), "bytes": path.stat().st_size, "pieces": records}
    _write_json(tmp / f"rank{rank:05d}.json", meta)


def _attach(tmp: Path, attach: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Copy the attached files in; their records for the index (size and sha256)."""
    records = {}
    for name, source in sorted(attach.items()):
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, path)
        _fsync(path)
        _fsync_dir(path.parent)
        records[name] = {"sha256": sha256(path), "bytes": path.stat().st_size}
    return records


def _write_index(tmp: Path, mesh: Mesh, trainer_state: dict[str, Any], step: int,
                 attached: dict[str, dict[str, Any]]) -> None:
    tensors: dict[str, dict[str, Any]] = {}
    files = dict(attached)
    for meta_path in sorted(tmp.glob("rank*.json")):
        meta = json.loads(meta_path.read_text())
        files[meta["file"]] = {"sha256": meta["sha256"], "bytes": meta["bytes"]}
        for rec in meta["pieces"]:
            entry = tensors.setdefault(rec["name"], {"shape": rec["full_shape"], "dtype": rec["dtype"], "pieces": []})
            entry["pieces"].append({"file": meta["file"], "key": rec["key"], "offsets": rec["offsets"],
                                    "lengths": rec["lengths"]})
        meta_path.unlink()
    index = {"format": FORMAT, "step": step, "world_size": mesh.env.world_size,
             "layout": mesh.layout.as_dict(),  # the layout that wrote it (plait.layout), for inspect
             "trainer": trainer_state, "files": files, "tensors": tensors}
    _write_json(tmp / "index.json", index)


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished directory into place, then point `latest` at it (both atomic)."""
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    link = root / ".latest-tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(final.name, link)
    os.replace(link, root / "latest")
    _fsync_dir(root)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (0 keeps all). An older one is first renamed out of
    the `step-*` names, so that one deleted halfway (a crash) is never taken for a checkpoint."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        os.replace(old, old.with_name(f".old-{old.name}"))
    for doomed in root.glob(".old-step-*"):  # these, and any an earlier crash left behind
        shutil.rmtree(doomed, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))
    _fsync(path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
