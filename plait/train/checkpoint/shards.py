"""Weights written as transformers writes a large model, a tensor at a time: sharded safetensors.

A model above `--max-shard-size` (transformers' default, 50 GB) becomes
`model-00001-of-0000N.safetensors`... with `model.safetensors.index.json` naming the file of
each tensor; a smaller one stays one `model.safetensors`. `from_pretrained` reads either.

Nothing here holds more than one block of a tensor: the plan (every tensor's name, shape and
dtype) is known before any byte is written, so each file's header is written first, and each
block of a tensor is written where it lies in the file as it arrives, in the plan's order of
tensors, then dropped. That is what lets a run write its weights without assembling even one
tensor (plait/train/loop/run.py receives each rank's blocks in turn) and an export stream
them out of a checkpoint. The format is
the published safetensors layout (an 8-byte little-endian header length, a JSON header of
dtypes, shapes and byte ranges, the bytes); the files are read back by the safetensors
library. Every file is written under a temporary name and renamed once complete, the index
last.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from plait.errors import PlaitError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
@dataclass(frozen=True)
class Entry:
    """One tensor of the plan: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_files(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """The tensors cut into files of at most `max_bytes` each, in order (a larger tensor alone)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files if files[0] else []


def file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardWriter:
    """Writes `entries` into `directory` as one or more safetensors files, a tensor at a time:
    `write(name, tensor)` in the entries' order, then `close()` (renames, index). `single`
    names the file when there is one; `replaces`: the directory's weights are these, and an
    earlier write's other files (its index, its shards of another count) are removed."""

    def __init__(self, directory: str | Path, entries: list[Entry], max_bytes: int,
                 metadata: dict[str, str] | None = None, single: str = SINGLE, replaces: bool = True):
        self.directory, self.replaces = Path(directory), replaces
        for entry in entries:
            if entry.dtype not in _DTYPES:
                raise PlaitError(f"{entry.name}: safetensors has no dtype {entry.dtype}",
                                 hint="cast the weights to a float or integer dtype first")
        planned = plan_files(entries, max_bytes)
        self.files = list(zip([single] if len(planned) == 1 else file_names(len(planned)), planned))
        self.metadata = {"format": "pt", **(metadata or {})}
        self.queue = [(name, entry) for name, chunk in self.files for entry in chunk]
        self.done: list[Path] = []
        self.current: tuple[str, BinaryIO] | None = None  # the file being written, under its temporary name
        self.position = 0
        self._starts: dict[str, int] = {}  # the current file's tensors: where each one's bytes begin
        self._covered = 0  # elements of the tensor being filled that its blocks have written
        self._seen: set[tuple[int, ...]] = set()  # ... and those blocks' offsets

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `name` whole; names come in the entries' order, shapes and dtypes as planned."""
        self.write_block(name, tensor, (0,) * tensor.ndim, tuple(tensor.shape))

    def write_block(self, name: str, block: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Write one block of `name` (of whole `shape`, at `offsets` in it) where it lies in the
        file, so that a tensor split over ranks never needs assembling: tensors come in the
        entries' order, a tensor's blocks in any order, and the next tensor may start once
        the blocks cover this one."""
        file, entry = self.queue[self.position]
        if name != entry.name or tuple(shape) != entry.shape or block.dtype != entry.dtype:
            raise PlaitError(f"the weights' writer expected {entry.name} {entry.shape} {entry.dtype}, got {name} "
                             f"{tuple(shape)} {block.dtype}", hint="report it with the layout")
        if tuple(offsets) in self._seen:  # two ranks wrote one block: a layout's pieces are wrong
            raise PlaitError(f"the weights of {name} got its block at {tuple(offsets)} twice",
                             hint="a strategy's checkpoint pieces do not tile its tensors; report it with the layout")
        if self.current is None or self.current[0] != file:
            self._start(file)
        data = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        handle, size = self._handle(), block.element_size()
        for at, start, length in contiguous_runs(entry.shape, tuple(block.shape), tuple(offsets)):
            handle.seek(self._starts[name] + at * size)
            handle.write(memoryview(data[start * size:(start + length) * size]))
        self._seen.add(tuple(offsets))
        self._covered += block.numel()
        if self._covered >= math.prod(entry.shape):
            self.position += 1
            self._covered, self._seen = 0, set()

    def _handle(self) -> BinaryIO:
        assert self.current is not None
        return self.current[1]

    def _temporary(self, file: str) -> Path:
        return self.directory / f".{file}.tmp-{os.getpid()}"

    def _start(self, file: str) -> None:
        self._finish_file()
        entries = dict(self.files)[file]
        header, offset = {"__metadata__": self.metadata}, 0
        for entry in entries:
            header[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        handle = open(self._temporary(file), "wb")
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        self._starts = {entry.name: 8 + len(encoded) + header[entry.name]["data_offsets"][0] for entry in entries}
        self.current = (file, handle)

    def _finish_file(self) -> None:
        if self.current is None:
            return
        file, handle = self.current
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(self._temporary(file), self.directory / file)
        self.done.append(self.directory / file)
        self.current = None

    def close(self) -> list[Path]:
        """Finish the last file and write the index (when there are several); the paths written."""
        if self.position != len(self.queue) or self._covered:
            raise PlaitError(f"the weights' writer got {self.position} of {len(self.queue)} tensors whole",
                             hint="report it with the layout")
        self._finish_file()
        if self.replaces:  # an earlier write's other files would shadow or confuse this one
            written = {self.directory / file for file, _ in self.files}
            stale = [self.directory / (INDEX if len(self.files) == 1 else SINGLE),
                     *(p for p in self.directory.glob("model-*-of-*.safetensors") if p not in written)]
            for path in stale:
                path.unlink(missing_ok=True)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for _, chunk in self.files for e in chunk)},
                     "weight_map": {e.name: file for file, chunk in self.files for e in chunk}}
            tmp = self.directory / f".{INDEX}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(index, indent=2) + "\n")
            os.replace(tmp, self.directory / INDEX)
            self.done.append(self.directory / INDEX)
        return self.done

    def abort(self) -> None:
        """Drop the file being written (the finished ones stay: each is whole)."""
        if self.current is not None:
            self.current[1].close()
            self._temporary(self.current[0]).unlink(missing_ok=True)
            self.current = None


def contiguous_runs(shape: tuple[int, ...], block: tuple[int, ...], offsets: tuple[int, ...]
                    ) -> Iterator[tuple[int, int, int]]:
    """Where a block of a row-major tensor of `shape` lies, as (element offset in the tensor,
    element offset in the block, length) runs: one run when the block is whole rows, else
    one for each index of the dimensions before its last cut one."""
    cut = max((d for d in range(len(shape)) if block[d] != shape[d]), default=-1)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    if cut < 0:
        yield 0, 0, math.prod(shape)
        return
    run = block[cut] * strides[cut]
    first = sum(o * s for o, s in zip(offsets, strides))
    for k, index in enumerate(itertools.product(*(range(n) for n in block[:cut]))):
        yield first + sum(i * s for i, s in zip(index, strides)), k * run, run


def write_streamed(directory: str | Path, weights: Mapping[str, torch.Tensor], max_bytes: int,
                   metadata: dict[str, str] | None = None, single: str = SINGLE,
                   replaces: bool = True) -> list[Path]:
    """`weights` (a LazyWeights reads each tensor only when asked) written a tensor at a time."""
    writer = ShardWriter(directory, entries_of(weights), max_bytes, metadata, single, replaces)
    try:
        for entry in writer.queue:
            writer.write(entry[1].name, weights[entry[1].name])
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def entries_of(weights: Mapping[str, torch.Tensor]) -> list[Entry]:
    """The plan of `weights`, in name order: from its own record when lazy, else its tensors."""
    if isinstance(weights, LazyWeights):
        return weights.entries()
    return [Entry(name, tuple(t.shape), t.dtype) for name, t in sorted(weights.items())]


class LazyWeights(Mapping[str, torch.Tensor]):
    """Whole tensors by name whose shapes and dtypes are known, each read only when asked:
    a checkpoint's (assembled from its pieces) or a run's output files."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], read: Callable[[str], torch.Tensor]):
        self._shapes, self._read = dict(sorted(shapes.items())), read

    def entries(self) -> list[Entry]:
        return [Entry(name, shape, dtype) for name, (shape, dtype) in self._shapes.items()]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}


def read_weights(directory: str | Path) -> LazyWeights:
    """The weights in `directory` (one file or an index's shards), each read when asked. A
    file is opened for each read and closed after it: the pages a read touches of a mapped
    file stay in the process's resident memory while the mapping lives."""
    files = weight_files(directory)
    shapes = {}
    for path in sorted(set(files.values())):
        with open_safetensors(path) as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shapes[name] = (tuple(piece.get_shape()), _FROM_CODE.get(piece.get_dtype(), torch.float32))
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise PlaitError(f"{files[missing[0]]} holds no tensor {missing[0]!r}, which its index names there",
                         hint="write the weights again")

    def read(name: str) -> torch.Tensor:
        with open_safetensors(files[name]) as handle:
            try:
                return handle.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
                raise PlaitError(f"{files[name]}: {name} cannot be read ({type(exc).__name__})",
                                 hint="the file is damaged: write the weights again") from None

    return LazyWeights({name: shapes[name] for name in files}, read)


def open_safetensors(path: Path) -> Any:
    """safetensors' handle on `path`, or one PlaitError naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types, the OS others
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlaitError(f"{path} is not a readable safetensors file ({reason})",
                         hint="the file is missing or damaged: write the weights again") from None


def weight_files(directory: str | Path) -> dict[str, Path]:
    """{tensor name: its file} of the weights in `directory` (one file or an index's shards)."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        bad = PlaitError(f"{directory / INDEX} is not a safetensors index (a weight_map of tensor names to the "
                         f"files beside it)", hint="write the weights again")
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise bad from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) and isinstance(file, str) and file and Path(file).name == file
                for name, file in weight_map.items()):
            raise bad
        return {name: directory / file for name, file in weight_map.items()}
    with open_safetensors(directory / SINGLE) as handle:
        return {name: directory / SINGLE for name in handle.keys()}


def has_weights(directory: str | Path) -> bool:
    return (Path(directory) / SINGLE).is_file() or (Path(directory) / INDEX).is_file()
