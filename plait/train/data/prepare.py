"""`plait data prepare`: tokenize a corpus once, into a token file every rank can map.

    plait data prepare --tokenizer bytes --data corpus/ --out data/corpus
    plait data prepare --tokenizer my-model/ --data corpus.txt --out data/corpus   # its tokenizer.json
    plait train --data data/corpus

The corpus is read file by file in the order `plait train` reads raw text (sorted, depth
first) and streamed out: memory stays a few chunks whatever its size. With a tokenizer,
text is encoded in chunks that end at a line break, without special tokens. The token
file and its index are written under temporary names and renamed, so an interrupted run
never leaves a directory that looks prepared. See plait/train/data/tokens.py for the format.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from plait.errors import PlaitError
from plait.train.data.tokens import (BUILTIN, TOKENIZER, TOKENS, VERIFIED, TokenIndex, dtype_for, edges_digest,
                                open_corpus_file, write_index)

TEXT_CHUNK = 1 << 20  # characters per encode call (a chunk ends at a line break)
BYTES_CHUNK = 1 << 22
LITTLE_ENDIAN = {"uint16": "<u2", "uint32": "<u4"}  # the file's byte order on any machine


def source_files(source: str) -> list[Path]:
    """The files of `--data`, in the order plait reads them: 'embedded', 'stdlib', a file or a
    directory."""
    from plait.train.data.tokens import TEXT_SUFFIXES, builtin_files, corpus_files

    builtin = builtin_files(source)
    if builtin is not None:
        return list(builtin)
    path = Path(source)
    if not path.exists():
        raise PlaitError(f"--data {source} does not exist", hint="give a text file, a directory, 'embedded' or 'stdlib'")
    return list(corpus_files(path, TEXT_SUFFIXES)) if path.is_dir() else [path]


def load_tokenizer(spec: str) -> tuple[Any, Path | None]:
    """(tokenizer, its tokenizer.json) for a directory or file; (None, None) for 'bytes'."""
    if spec == "bytes":
        return None, None
    path = Path(spec)
    path = path / TOKENIZER if path.is_dir() else path
    if not path.is_file():
        raise PlaitError(f"--tokenizer {spec}: no {TOKENIZER} there",
                         hint="give a directory holding tokenizer.json (a Hugging Face model's), the file, or 'bytes'")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PlaitError("--tokenizer needs the `tokenizers` library", hint="pip install 'plait[hf]'") from None
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as exc:  # noqa: BLE001 - the library raises its own untyped errors
        raise PlaitError(f"--tokenizer {path} cannot be read: {exc}") from None


def _byte_chunks(files: list[Path]) -> Iterator[np.ndarray]:
    for path in files:
        with open_corpus_file(path) as handle:
            while chunk := handle.read(BYTES_CHUNK):
                yield np.frombuffer(chunk, dtype=np.uint8)


def _text_chunks(files: list[Path]) -> Iterator[str]:
    """About TEXT_CHUNK characters at a time, each ending at a line break (or a file's end)."""
    for path in files:
        with io.TextIOWrapper(open_corpus_file(path), encoding="utf-8", errors="replace", newline="") as handle:
            while True:
                lines = handle.readlines(TEXT_CHUNK)
                if not lines:
                    break
                yield "".join(lines)


def text_chunks(text: str) -> Iterator[str]:
    """An in-memory text cut as a file is: about TEXT_CHUNK characters, ending at line breaks."""
    handle = io.StringIO(text, newline="")
    while lines := handle.readlines(TEXT_CHUNK):
        yield "".join(lines)


def encode_texts(tokenizer: Any, texts: Iterable[str], batch: int = 8) -> Iterator[np.ndarray]:
    """Token ids of each text chunk (no special tokens), encoded `batch` chunks at a time."""
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            yield from (np.asarray(e.ids) for e in tokenizer.encode_batch(pending, add_special_tokens=False))
            pending = []
    if pending:
        yield from (np.asarray(e.ids) for e in tokenizer.encode_batch(pending, add_special_tokens=False))


def prepare(tokenizer_spec: str, source: str, out: str) -> TokenIndex:
    """Tokenize `source` into `out` (tokens.bin, index.json, tokenizer.json); return the index."""
    files = source_files(source)
    tokenizer, tokenizer_file = load_tokenizer(tokenizer_spec)
    vocab = 256 if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for(vocab)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{TOKENS}.{os.getpid()}"
    digest, count = hashlib.sha256(), 0
    chunks = _byte_chunks(files) if tokenizer is None else encode_texts(tokenizer, _text_chunks(files))
    try:
        with open(tmp, "wb") as handle:
            for ids in chunks:
                data = ids.astype(LITTLE_ENDIAN[dtype]).tobytes()
                handle.write(data)
                digest.update(data)
                count += len(ids)
            if count == 0:
                raise PlaitError(f"--data {source} holds no text", hint="point --data at files with text in them")
            handle.flush()
            os.fsync(handle.fileno())
        with open(tmp, "rb") as handle:
            edges = edges_digest(handle, count * np.dtype(dtype).itemsize)
        (directory / VERIFIED).unlink(missing_ok=True)
        os.replace(tmp, directory / TOKENS)
    finally:
        tmp.unlink(missing_ok=True)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, directory / TOKENIZER)
    else:
        (directory / TOKENIZER).unlink(missing_ok=True)
    index = TokenIndex(dtype=dtype, count=count, vocab_size=vocab,
                       tokenizer="bytes" if tokenizer_file is None else str(tokenizer_file.resolve()),
                       source=source if source in BUILTIN else str(Path(source).resolve()),
                       sha256=digest.hexdigest(), edges_sha256=edges)
    write_index(directory, index)
    return index


def data_main(argv: list[str]) -> int:
    """`plait data prepare ...`"""
    parser = argparse.ArgumentParser(prog="plait data", description="Prepare corpora for `plait train --data`.")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize a corpus once into a memory-mapped token file")
    prep.add_argument("--tokenizer", required=True,
                      help="'bytes' (vocabulary 256), or a directory holding tokenizer.json, or the file")
    prep.add_argument("--data", required=True, help="a text file, a directory of text files, 'embedded' or 'stdlib'")
    prep.add_argument("--out", required=True, help="the directory to write (then: plait train --data OUT)")
    prep.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    index = prepare(args.tokenizer, args.data, args.out)
    print(f"wrote {index.count:,} tokens ({index.dtype}, vocabulary {index.vocab_size:,}) to "
          f"{Path(args.out) / TOKENS}; sha256 {index.sha256[:16]}…; train with: plait train --data {args.out}")
    return 0
