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


FIELDS = {"completion": ("prompt", "completion"), "chat": ("messages",)}  # each fine-tuning format's fields
ROLES = ("system", "user", "assistant", "tool", "developer")


class Documents:
    """The documents of `--data PATH` (records), in order; `bad` holds what was skipped.

    `data_format`: "text" yields each record's `text_field` (a string); "completion" its
    (prompt, completion) strings; "chat" its `messages`, a list of {"role", "content"}
    with at least one assistant turn (the turns the loss falls on)."""

    def __init__(self, path: Path, text_field: str = "text", data_format: str = "text"):
        self.path, self.format = path, data_format
        self.fields = FIELDS.get(data_format, (text_field,))
        self.field = ", ".join(self.fields)
        self.bad = Bad()
        self.files = [path] if record_kind(path) is not None else list(record_sources(path))
        if not self.files:
            raise PlaitError(f"--data {path} holds no jsonl, parquet or datasets records",
                             hint="give .jsonl, .jsonl.gz or .parquet files, or a folder written by save_to_disk")

    def __iter__(self) -> Iterator[Any]:
        for source in self.files:
            usable, bad_before = 0, self.bad.count
            for where, values in self._values(source):
                document = self._document(where, values)
                if document is not None:
                    usable += 1
                    yield document
            if usable == 0:
                bad = self.bad.count - bad_before
                raise PlaitError(f"--data {source} holds no usable record"
                                 + (f": {bad} bad, e.g. {self.bad.named[-1] if self.bad.named else ''}" if bad else
                                    " (it is empty)"),
                                 hint=f"check its records' {self.field} field(s)" + (
                                     ", or name another with --field" if self.format == "text" else
                                     ", or give --format text"))

    def _document(self, where: str, values: tuple[Any, ...]) -> Any:
        """The document a record holds, or None (counted as bad, with the reason)."""
        for name, value in zip(self.fields, values):
            if value is _MISSING:
                self.bad.add(where, f"no field {name!r}")
                return None
        if self.format == "chat":
            return self._messages(where, values[0])
        texts = []
        for name, value in zip(self.fields, values):
            if not isinstance(value, str):
                self.bad.add(where, f"field {name!r} is {type(value).__name__}, not a string")
                return None
            texts.append(value)
        if not texts[-1]:
            self.bad.add(where, "empty document" if self.format == "text" else "empty completion")
            return None
        return texts[0] if self.format == "text" else tuple(texts)

    def _messages(self, where: str, value: Any) -> list[dict[str, str]] | None:
        if not isinstance(value, list) or not value:
            self.bad.add(where, "messages is not a non-empty list")
            return None
        turns = []
        for i, turn in enumerate(value):
            role = turn.get("role") if isinstance(turn, dict) else None
            content = turn.get("content") if isinstance(turn, dict) else None
            if role not in ROLES or not isinstance(content, str):
                self.bad.add(where, f"message {i} is not {{role: {'|'.join(ROLES)}, content: string}}")
                return None
            turns.append({"role": role, "content": content})
        if not any(t["role"] == "assistant" for t in turns):
            self.bad.add(where, "no assistant turn (nothing would carry the loss)")
            return None
        return turns

    def _values(self, source: Path) -> Iterator[tuple[str, tuple[Any, ...]]]:
        kind = record_kind(source)
        if kind == "jsonl":
            yield from self._jsonl(source)
        elif kind == "parquet":
            yield from _arrow_values(source, self.fields, _parquet_batches(source, self.fields))
        else:
            for file in dataset_files(source):
                yield from _arrow_values(file, self.fields, _stream_batches(file, self.fields))

    def _jsonl(self, path: Path) -> Iterator[tuple[str, tuple[Any, ...]]]:
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
                    self._same_format(where, record)
                    yield where, tuple(record.get(name, _MISSING) for name in self.fields)
        except (OSError, EOFError) as exc:  # a truncated gzip, a file that vanished
            raise PlaitError(f"--data {path} cannot be read: {exc}", hint="check the file") from None

    def _same_format(self, where: str, record: dict[str, Any]) -> None:
        """Refuse a record of another format than the corpus's: prompts and chats mixed with
        text, or with each other, would train on what no one meant."""
        other = format_of(record.keys(), "text" if self.format != "text" else self.fields[0])
        if other != self.format and not any(name in record for name in self.fields):
            raise PlaitError(f"--data mixes record formats: {where} is a {other} record, the corpus is {self.format} "
                             f"(from its first record)", hint="prepare each format into a corpus of its own, or "
                                                              "give --format to read one field set from every record")


def format_of(keys: Any, text_field: str = "text") -> str:
    """The format a record's keys (or a table's columns) say: chat for `messages`, completion
    for `prompt` and `completion`, else text."""
    keys = set(keys)
    if "messages" in keys:
        return "chat"
    if {"prompt", "completion"} <= keys:
        return "completion"
    return "text"


def first_keys(path: Path) -> list[str]:
    """The keys of the first record of `--data PATH` (a jsonl line's, a table's columns)."""
    files = [path] if record_kind(path) is not None else list(record_sources(path))
    for source in files:
        kind = record_kind(source)
        if kind == "jsonl":
            opener = gzip.open if source.name.lower().endswith(".gz") else open
            try:
                with opener(source, "rb") as handle:
                    for raw in handle:
                        try:
                            record = json.loads(raw)
                        except ValueError:
                            continue
                        if isinstance(record, dict):
                            return list(record)
            except (OSError, EOFError):
                continue
        else:
            pa = _pyarrow()
            try:
                if kind == "parquet":
                    return list(pa.parquet.ParquetFile(str(source)).schema_arrow.names)
                first = dataset_files(source)[0]
                with pa.memory_map(str(first), "r") as stream:
                    return list(pa.ipc.open_stream(stream).schema.names)
            except (OSError, IndexError, pa.ArrowException):
                continue
    return []


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


def _parquet_batches(path: Path, columns: tuple[str, ...]) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        handle = pa.parquet.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise PlaitError(f"--data {path} is not a readable parquet file ({exc})", hint="check the file") from None
    if not set(columns) <= set(handle.schema_arrow.names):
        yield None  # every row lacks a field
        return
    yield from handle.iter_batches(batch_size=ROWS, columns=list(columns))


def _stream_batches(path: Path, columns: tuple[str, ...]) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        with pa.memory_map(str(path), "r") as source:
            reader = pa.ipc.open_stream(source)
            if not set(columns) <= set(reader.schema.names):
                yield None
                return
            for batch in reader:
                yield batch.select(list(columns))
    except pa.ArrowException as exc:
        raise PlaitError(f"--data {path} is not a readable Arrow stream ({exc})", hint="check the file") from None


def _arrow_values(path: Path, columns: tuple[str, ...], batches: Iterator[Any]) -> Iterator[tuple[str, tuple]]:
    """(file:row, the fields' values) of each row; a file without the columns yields each row as missing."""
    row = 0
    for batch in batches:
        if batch is None:
            count = _row_count(path)
            for row in range(count):
                yield f"{path}:row {row}", (_MISSING,) * len(columns)
            return
        for values in zip(*(batch.column(i).to_pylist() for i in range(len(columns)))):
            yield f"{path}:row {row}", tuple(values)
            row += 1


def _row_count(path: Path) -> int:
    pa = _pyarrow()
    if path.name.lower().endswith(PARQUET):
        return pa.parquet.ParquetFile(str(path)).metadata.num_rows
    with pa.memory_map(str(path), "r") as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
