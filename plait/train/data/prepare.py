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

import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from plait.errors import CommandParser, PlaitError
from plait.rules import DATA_FORMATS
from plait.train.data.records import FIELDS, Documents, first_keys, format_of, is_records
from plait.train.data.tokens import (BUILTIN, DOCUMENTS, LOSS_MASK, TEXT_SUFFIXES, TOKENIZER, TOKENS, VERIFIED, TokenIndex,
                                     builtin_files, corpus_files, dtype_for, edges_digest, open_corpus_file,
                                     write_index)

TEXT_CHUNK = 1 << 20  # characters per encode call (a chunk ends at a line break)
BYTES_CHUNK = 1 << 22
LITTLE_ENDIAN = {"uint16": "<u2", "uint32": "<u4"}  # the file's byte order on any machine


def source_files(source: str) -> list[Path]:
    """The files of `--data`, in the order plait reads them: 'embedded', 'stdlib', a file or a
    directory."""
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


def prepare(tokenizer_spec: str, source: str, out: str, text_field: str = "text", workers: int = 1,
            eos: str | None = None, data_format: str = "auto") -> TokenIndex:
    """Tokenize `source` into `out` (tokens.bin, index.json, tokenizer.json, and documents.bin
    for records, loss_mask.bin for completion and chat records); return the index. Text is one
    stream, as it always was; records (jsonl, parquet, a datasets folder) are documents, each
    followed by the end-of-document id. `data_format` "auto": the first record's keys choose."""
    if workers < 1:
        raise PlaitError(f"--workers {workers}: give 1 or more", hint="--workers 2 tokenizes in two processes")
    if data_format not in ("auto", *DATA_FORMATS):
        raise PlaitError(f"--format {data_format!r} is not one of: auto, {', '.join(DATA_FORMATS)}",
                         hint="e.g. --format completion")
    records = source not in BUILTIN and Path(source).exists() and is_records(Path(source))
    if not records and data_format in FIELDS:
        raise PlaitError(f"--format {data_format} reads records (jsonl, parquet, a datasets folder), and --data "
                         f"{source} is text", hint="give records with prompt/completion or messages, or drop --format")
    if records and data_format == "auto":
        data_format = format_of(first_keys(Path(source)), text_field)
    data_format = data_format if records else "text"
    if records and Path(source).is_dir():
        text = next(corpus_files(Path(source), TEXT_SUFFIXES), None)
        if text is not None:  # one kind a corpus: records would leave the text files out
            raise PlaitError(f"--data {source} holds records and text files (e.g. {text})",
                             hint="prepare each kind into a corpus of its own, then blend them: "
                                  "--data 0.5:DIR_A,0.5:DIR_B")
    files = [] if records else source_files(source)
    tokenizer, tokenizer_file = load_tokenizer(tokenizer_spec)
    template = chat_template(tokenizer_file) if data_format == "chat" else None
    eos_id = end_of_document(tokenizer, tokenizer_file, eos) if records else None
    vocab = 256 if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)
    if eos_id is not None and tokenizer is None:
        vocab = max(vocab, eos_id + 1)  # bytes: the end-of-document id is a token of its own
    dtype = dtype_for(vocab)
    directory = _out_directory(out)
    tokens = _Stream(directory / TOKENS, LITTLE_ENDIAN[dtype])
    ends = _Stream(directory / DOCUMENTS, "<u8") if records else None
    carries = _Stream(directory / LOSS_MASK, "u1") if data_format in FIELDS else None
    documents = Documents(Path(source), text_field, data_format) if records else None
    try:
        if documents is not None and ends is not None:
            for ids, mask in document_ids(documents, tokenizer_file, eos_id, workers, data_format, template):
                tokens.write(ids)
                ends.write(np.asarray([tokens.count], dtype=np.uint64))
                if carries is not None:
                    carries.write(mask)
        else:
            for ids in (_byte_chunks(files) if tokenizer is None else encode_texts(tokenizer, _text_chunks(files))):
                tokens.write(ids)
        if tokens.count == 0:
            raise PlaitError(f"--data {source} holds no text", hint="point --data at files with text in them")
        edges = tokens.finish()
        (directory / VERIFIED).unlink(missing_ok=True)
        tokens.publish()
        for stream, name in ((ends, DOCUMENTS), (carries, LOSS_MASK)):
            if stream is not None:
                stream.finish()
                stream.publish()
            else:
                (directory / name).unlink(missing_ok=True)
    finally:
        for stream in (tokens, ends, carries):
            if stream is not None:
                stream.discard()
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, directory / TOKENIZER)
    else:
        (directory / TOKENIZER).unlink(missing_ok=True)
    index = TokenIndex(dtype=dtype, count=tokens.count, vocab_size=vocab,
                       tokenizer="bytes" if tokenizer_file is None else str(tokenizer_file.resolve()),
                       source=source if source in BUILTIN else str(Path(source).resolve()),
                       sha256=tokens.digest.hexdigest(), edges_sha256=edges,
                       documents=ends.count if ends is not None else 0, eos=eos_id,
                       documents_sha256=ends.digest.hexdigest() if ends is not None else "",
                       bad_records=documents.bad.count if documents is not None else 0,
                       data_format=data_format, loss_mask=carries is not None)
    write_index(directory, index)
    _write_skipped(directory, documents.bad if documents is not None else None)
    return index


SKIPPED = "skipped.txt"  # the records prepare skipped, one a line (the first NAMED), beside index.json


def _write_skipped(directory: Path, bad: Any) -> None:
    """The skipped records, named, kept beside the corpus so that what was left out stays known."""
    path = directory / SKIPPED
    if bad is None or not bad.count:
        path.unlink(missing_ok=True)
        return
    more = [f"... and {bad.count - len(bad.named):,} more"] if bad.count > len(bad.named) else []
    path.write_text("\n".join([*bad.named, *more]) + "\n")


def _out_directory(out: str) -> Path:
    """`--out`, created; refused when it names a file."""
    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise PlaitError(f"--out {out} is a file", hint="give a directory to write the prepared corpus into")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class _Stream:
    """An array file written under a temporary name, hashed as it goes, renamed once whole."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}")
        self.handle = open(self.tmp, "wb")
        self.digest, self.count = hashlib.sha256(), 0

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.handle.write(data)
        self.digest.update(data)
        self.count += len(ids)

    def finish(self) -> str:
        """Flush to disk; the hash of its edges (tokens.py: edges_digest)."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        with open(self.tmp, "rb") as handle:
            return edges_digest(handle, self.count * np.dtype(self.dtype).itemsize)

    def publish(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def end_of_document(tokenizer: Any, tokenizer_file: Path | None, eos: str | None) -> int:
    """The id written after each document: `--eos` (an id, or a token of the vocabulary), else
    the tokenizer's own end-of-sequence token (tokenizer_config.json's eos_token beside its
    tokenizer.json), else for bytes 256, one past the bytes."""
    if eos is not None and eos.isdigit():
        return int(eos)
    if tokenizer is None:
        if eos is not None:
            raise PlaitError(f"--eos {eos!r}: with --tokenizer bytes give an id (256 or more keeps it apart "
                             "from every byte)", hint="drop --eos: bytes end each document with 256")
        return 256
    token = eos if eos is not None else _configured_eos(tokenizer_file)
    if token is None:
        raise PlaitError(f"--tokenizer {tokenizer_file}: no end-of-sequence token is configured beside it "
                         f"(tokenizer_config.json's eos_token)", hint="name one with --eos TOKEN or --eos ID")
    found = tokenizer.token_to_id(token)
    if found is None:
        raise PlaitError(f"--eos {token!r} is not a token of {tokenizer_file}", hint="give a token it has, or an id")
    return int(found)


def _configured_eos(tokenizer_file: Path | None) -> str | None:
    if tokenizer_file is None:
        return None
    try:
        config = json.loads((tokenizer_file.parent / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    token = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


DOCS_PER_BATCH, CHARS_PER_BATCH = 1024, 1 << 20  # documents encoded at a time


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) == DOCS_PER_BATCH or chars >= CHARS_PER_BATCH:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def document_ids(documents: Iterable[Any], tokenizer_file: Path | None, eos: int, workers: int,
                 data_format: str = "text", template: Any = None) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each document's ids followed by `eos`, and (completion, chat) which of them carry the
    loss, in order: encoded a batch at a time, by `workers` processes (each batch's result
    comes back in the order it was sent)."""
    batches = _batches(documents)
    setup = (tokenizer_file, eos, data_format, template)
    if workers == 1:
        _start_worker(*setup)
        for batch in batches:
            yield from _encode(batch)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fork would copy the tokenizer's threads
    with context.Pool(workers, initializer=_start_worker, initargs=(*setup, True)) as pool:
        for encoded in pool.imap(_encode, batches):
            yield from encoded


_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_file: Path | None, eos: int, data_format: str = "text", template: Any = None,
                  one_thread: bool = False) -> None:
    """Load the tokenizer once per process. A pool's workers each encode on one thread: the
    processes are the parallelism, while the main one reads and writes beside them."""
    if one_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = None
    if tokenizer_file is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    _WORKER.update(tokenizer=tokenizer, eos=np.asarray([eos], dtype=np.int64), format=data_format, template=template)


def _encode(batch: list[Any]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    tokenizer, eos, data_format = _WORKER["tokenizer"], _WORKER["eos"], _WORKER["format"]
    if data_format == "completion":
        return [_completion(tokenizer, prompt, completion, eos) for prompt, completion in batch]
    if data_format == "chat":
        return [_chat(tokenizer, _WORKER["template"], messages, eos) for messages in batch]
    if tokenizer is None:
        return [(np.concatenate([np.frombuffer(text.encode("utf-8"), dtype=np.uint8), eos]), None) for text in batch]
    return [(np.concatenate([np.asarray(e.ids, dtype=np.int64), eos]), None)
            for e in tokenizer.encode_batch(batch, add_special_tokens=False)]


def _ids(tokenizer: Any, text: str) -> np.ndarray:
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def _completion(tokenizer: Any, prompt: str, completion: str, eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """encode(prompt) + encode(completion) + [eos]; the loss on the completion and the eos."""
    asked, answer = _ids(tokenizer, prompt), _ids(tokenizer, completion)
    mask = np.concatenate([np.zeros(len(asked), np.uint8), np.ones(len(answer) + 1, np.uint8)])
    return np.concatenate([asked, answer, eos]), mask


def _chat(tokenizer: Any, template: "ChatTemplate", messages: list[dict[str, str]],
          eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chat rendered by its template + [eos]; the loss on the tokens of assistant turns
    (their text up to the next turn, the template's end-of-turn mark included) and the eos."""
    text, spans = template.render(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return np.concatenate([np.asarray(encoding.ids, dtype=np.int64), eos]), np.concatenate([mask, [1]]).astype(np.uint8)


class ChatTemplate:
    """A tokenizer's chat template (tokenizer_config.json's `chat_template`, or
    chat_template.jinja beside it), rendered by transformers' own renderer.

    `render(messages)` gives the text and each assistant turn's span in it: the chat rendered
    up to the turn with the generation prompt, then with the turn, must each begin the whole
    rendering (a template that rewrites earlier turns cannot say which text is whose)."""

    def __init__(self, source: str, text: str, specials: dict[str, str]):
        self.source, self.text, self.specials = source, text, specials

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([messages], chat_template=self.text, add_generation_prompt=prompt,
                                            **self.specials)
        return rendered[0]

    def render(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        whole = self._render(messages, False)
        spans = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before, through = self._render(messages[:i], True), self._render(messages[:i + 1], False)
            if not (whole.startswith(through) and through.startswith(before)):
                raise PlaitError(f"the chat template of {self.source} does not render a chat turn by turn (turn {i} "
                                 "changes the text before it), so the assistant's tokens cannot be told apart",
                                 hint="prepare these chats with another tokenizer's template, or as --format text")
            spans.append((len(before), len(through)))
        return whole, spans

    def __reduce__(self) -> Any:  # sent to spawned workers as its text
        return ChatTemplate, (self.source, self.text, self.specials)


def chat_template(tokenizer_file: Path | None) -> ChatTemplate:
    """The chat template beside `tokenizer_file`, and the special tokens templates read."""
    if tokenizer_file is None:
        raise PlaitError("--format chat renders each chat with a tokenizer's chat template, and --tokenizer bytes has "
                         "none", hint="give --tokenizer DIR holding tokenizer.json and a chat template")
    directory = tokenizer_file.parent
    config: dict[str, Any] = {}
    try:
        loaded = json.loads((directory / "tokenizer_config.json").read_text())
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates: the default one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja = directory / "chat_template.jinja"
    if not isinstance(text, str) and jinja.is_file():
        text = jinja.read_text()
    if not isinstance(text, str) or not text.strip():
        raise PlaitError(f"--format chat: {directory} has no chat template (tokenizer_config.json's chat_template, "
                         "or chat_template.jinja)", hint="give a tokenizer directory with one, or --format completion")
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[name] = value
    return ChatTemplate(str(directory), text, specials)


def data_main(argv: list[str]) -> int:
    """`plait data prepare ...`"""
    parser = CommandParser(prog="plait data", description="Prepare corpora for `plait train --data`.")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize a corpus once into a memory-mapped token file")
    prep.add_argument("--tokenizer", required=True,
                      help="'bytes' (vocabulary 256), or a directory holding tokenizer.json, or the file")
    prep.add_argument("--data", required=True,
                      help="a text file or directory of them, 'embedded' or 'stdlib' (one stream); or records: "
                           ".jsonl, .jsonl.gz, .parquet, a datasets save_to_disk folder, or a directory of them "
                           "(each record one document, followed by the end-of-document id)")
    prep.add_argument("--out", required=True, help="the directory to write (then: plait train --data OUT)")
    prep.add_argument("--field", default="text", help="records: the field holding each document's text (default text)")
    prep.add_argument("--workers", type=int, default=1, help="records: processes that tokenize (default 1)")
    prep.add_argument("--eos", default=None,
                      help="records: the id or token after each document (default: the tokenizer's eos_token "
                           "from tokenizer_config.json; 256 for bytes)")
    prep.add_argument("--format", default="auto", dest="data_format",
                      help="records: text (the --field), completion (prompt and completion: the loss on the "
                           "completion), chat (messages, rendered by the tokenizer's chat template: the loss on "
                           "assistant turns); auto: from the first record's keys")
    prep.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    if not args.out.strip() or not args.data.strip():
        raise PlaitError("--data and --out must name something", hint="e.g. --data corpus.jsonl --out data/corpus")
    index = prepare(args.tokenizer, args.data, args.out, args.field, args.workers, args.eos, args.data_format)
    if index.documents:
        chosen = "from the first record's keys" if args.data_format == "auto" else "as --format says"
        carried = {"completion": ": the loss on each completion and its end", "chat": ": the loss on assistant turns"}
        print(f"records read as {index.data_format} ({chosen}){carried.get(index.data_format, '')}")
    documents = f" in {index.documents:,} documents (each ended by id {index.eos})" if index.documents else ""
    print(f"wrote {index.count:,} tokens{documents} ({index.dtype}, vocabulary {index.vocab_size:,}) to "
          f"{Path(args.out) / TOKENS}; sha256 {index.sha256[:16]}…; train with: plait train --data {args.out}")
    if index.bad_records:
        named = (Path(args.out) / SKIPPED).read_text().splitlines()
        print(f"skipped {index.bad_records:,} bad record(s), named in {Path(args.out) / SKIPPED}: "
              f"{', '.join(named[:3])}{', ...' if index.bad_records > 3 else ''}")
    return 0
