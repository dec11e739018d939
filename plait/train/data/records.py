"""Documents from the files corpora are kept in: jsonl, jsonl.gz, parquet, a `datasets` folder.

`plait data prepare --data PATH` reads records where text files hold plain text:

    .jsonl, .jsonl.gz   one JSON object a line; the document is its `--field` (default "text")
    .parquet            the `--field` column, read a batch of rows at a time
    a `datasets` folder what `Dataset.save_to_disk` writes (state.json naming its .arrow files,
                        Arrow streams), read a batch at a time

A directory of such files is read in the order plait reads any corpus (sorted, depth first).
Each record is one document. Memory stays a batch of records whatever the input's size.

A record that cannot be a document is not dropped in silence: it is counted and named by
file and line (or row) with the reason, namely not JSON, not UTF-8, not an object, no such
field, a field that is not a string, or an empty document. The caller reports them, and
refuses a file with nothing usable in it.

torch-free; pyarrow only for parquet and Arrow (the `data` extra).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import PlaitError

JSONL = (".jsonl", ".jsonl.gz")
PARQUET = ".parquet"
DATASET_STATE = "state.json"  # what save_to_disk writes beside its .arrow files
ROWS = 1024  # records read at a time from parquet and Arrow
NAMED = 20  # bad records named one by one (the rest are counted)


def readable(path: Path) -> Path:
    """`path`, refused in one line when it is a link that points nowhere (it would fail later,
    raw, when read)."""
    if path.is_symlink() and not path.exists():
        raise PlaitError(f"--data: {path} is a link to {os.readlink(path)}, which does not exist",
                         hint="remove the link, or restore what it points to")
    return path


def record_kind(path: Path) -> str | None:
    """"jsonl", "parquet" or "dataset" for a file or folder of records; None for text."""
    if path.is_dir():
        return "dataset" if (path / DATASET_STATE).is_file() else None
    name = path.name.lower()
    if name.endswith(JSONL):
        return "jsonl"
    if name.endswith(PARQUET):
        return "parquet"
    return None


def is_records(path: Path) -> bool:
    """Whether `--data PATH` holds records (a file or folder of them, or a directory with any)."""
    if record_kind(path) is not None:
        return True
    return path.is_dir() and any(True for _ in record_sources(path))


def record_sources(root: Path) -> Iterator[Path]:
    """The record files and `datasets` folders under a directory, sorted, depth first."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here != root and (here / DATASET_STATE).is_file():
            dirnames[:] = []
            yield here
            continue
        dirnames[:] = sorted(dirnames)
        for name in sorted(filenames):
            if record_kind(here / name) in ("jsonl", "parquet"):
                yield readable(here / name)


@dataclass
class Bad:
    """Records that could not be documents: how many, and the first few by place and reason."""

    count: int = 0
    named: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.count += 1
        if len(self.named) < NAMED:
            self.named.append(f"{where} ({why})")

    def text(self, shown: int = 3) -> str:
        more = f", and {self.count - shown} more" if self.count > shown else ""
        return ", ".join(self.named[:shown]) + more


class Documents:
    """The documents of `--data PATH` (records), in order; `bad` holds what was skipped."""

    def __init__(self, path: Path, text_field: str = "text"):
        self.path, self.field = path, text_field
        self.bad = Bad()
        self.files = [path] if record_kind(path) is not None else list(record_sources(path))
        if not self.files:
            raise PlaitError(f"--data {path} holds no jsonl, parquet or datasets records",
                             hint="give .jsonl, .jsonl.gz or .parquet files, or a folder written by save_to_disk")

    def __iter__(self) -> Iterator[str]:
        for source in self.files:
            usable, bad_before = 0, self.bad.count
            for where, value in self._values(source):
                text = self._text(where, value)
                if text is not None:
                    usable += 1
                    yield text
            if usable == 0:
                bad = self.bad.count - bad_before
                raise PlaitError(f"--data {source} holds no usable record"
                                 + (f": {bad} bad, e.g. {self.bad.named[-1] if self.bad.named else ''}" if bad else
                                    " (it is empty)"),
                                 hint=f"check its records' {self.field!r} field, or name another with --field")

    def _text(self, where: str, value: Any) -> str | None:
        """The document a record holds, or None (counted as bad, with the reason)."""
        if value is _MISSING:
            self.bad.add(where, f"no field {self.field!r}")
        elif not isinstance(value, str):
            self.bad.add(where, f"field {self.field!r} is {type(value).__name__}, not a string")
        elif not value:
            self.bad.add(where, "empty document")
        else:
            return value
        return None

    def _values(self, source: Path) -> Iterator[tuple[str, Any]]:
        kind = record_kind(source)
        if kind == "jsonl":
            yield from self._jsonl(source)
        elif kind == "parquet":
            yield from _arrow_values(source, self.field, _parquet_batches(source, self.field))
        else:
            for file in dataset_files(source):
                yield from _arrow_values(file, self.field, _stream_batches(file, self.field))

    def _jsonl(self, path: Path) -> Iterator[tuple[str, Any]]:
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        try:
            with opener(path, "rb") as handle:
                for number, raw in enumerate(handle, 1):
                    where = f"{path}:{number}"
                    if not raw.strip():
                        continue  # a blank line holds no record
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        self.bad.add(where, "not UTF-8")
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        self.bad.add(where, "not JSON")
                        continue
                    if not isinstance(record, dict):
                        self.bad.add(where, f"a JSON {type(record).__name__}, not an object")
                        continue
                    yield where, record.get(self.field, _MISSING)
        except (OSError, EOFError) as exc:  # a truncated gzip, a file that vanished
            raise PlaitError(f"--data {path} cannot be read: {exc}", hint="check the file") from None


_MISSING = object()


def dataset_files(folder: Path) -> list[Path]:
    """The .arrow files of a save_to_disk folder, in the order its state.json lists them."""
    try:
        state = json.loads((folder / DATASET_STATE).read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlaitError(f"--data {folder}: {DATASET_STATE} does not name its data files ({type(exc).__name__})",
                         hint="write the folder again with Dataset.save_to_disk") from None
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise PlaitError(f"--data {folder}: {missing[0].name}, named by {DATASET_STATE}, is missing",
                         hint="copy the whole folder save_to_disk wrote")
    return files


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise PlaitError("reading parquet or a datasets folder needs pyarrow",
                         hint="pip install 'plait[data]'") from None
    return pyarrow


def _parquet_batches(path: Path, column: str) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        handle = pa.parquet.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise PlaitError(f"--data {path} is not a readable parquet file ({exc})", hint="check the file") from None
    if column not in handle.schema_arrow.names:
        yield None  # every row lacks the field
        return
    yield from handle.iter_batches(batch_size=ROWS, columns=[column])


def _stream_batches(path: Path, column: str) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        with pa.memory_map(str(path), "r") as source:
            reader = pa.ipc.open_stream(source)
            if column not in reader.schema.names:
                yield None
                return
            for batch in reader:
                yield batch.select([column])
    except pa.ArrowException as exc:
        raise PlaitError(f"--data {path} is not a readable Arrow stream ({exc})", hint="check the file") from None


def _arrow_values(path: Path, column: str, batches: Iterator[Any]) -> Iterator[tuple[str, Any]]:
    """(file:row, the field's value) of each row; a file without the column yields each row as missing."""
    row = 0
    for batch in batches:
        if batch is None:
            count = _row_count(path)
            for row in range(count):
                yield f"{path}:row {row}", _MISSING
            return
        for value in batch.column(0).to_pylist():
            yield f"{path}:row {row}", value
            row += 1


def _row_count(path: Path) -> int:
    pa = _pyarrow()
    if path.name.lower().endswith(PARQUET):
        return pa.parquet.ParquetFile(str(path)).metadata.num_rows
    with pa.memory_map(str(path), "r") as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
