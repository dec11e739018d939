"""Prepared corpora: a token file every rank maps, its index, and the checks that trust it.

`plait data prepare` (plait/train/data/prepare.py) writes a directory:

    tokens.bin      the token ids, little-endian uint16 (vocabulary ≤ 65,536) or uint32
    index.json      dtype, count, vocab_size, tokenizer, source, sha256 of tokens.bin, and
                    sha256 of its first and last EDGE bytes; for records (jsonl, parquet, a
                    datasets folder), the number of documents, the EOS id after each, and
                    the records skipped
    documents.bin   records only: each document's end offset in tokens.bin, little-endian uint64
    tokenizer.json  a copy of the tokenizer, when one was used (to print samples as text)

Every rank maps tokens.bin (`plait.train.data.corpus.load_corpus`) rather than reading it, so a
corpus of any size costs each process only the pages its batches touch. Trust is checked
so that it costs little per rank and nothing per step:
- every load, every rank: the file's size is count × itemsize and its two edges hash to
  the index's (a truncated, overwritten or swapped file fails here, named);
- the full sha256, by streaming reads (never through the map, which would make every
  page resident), once at prepare, and at the first load after the file changed, on the
  node's first rank: the result is remembered in verified.json beside it (size, mtime, hash).

Raw text (`--data FILE|DIR`, and the two built-in corpora, `embedded` and `stdlib`) is named
here too: which files a source holds and whether they fit the 8 MiB every rank reads whole.

torch-free: `plait train` checks a corpus (and fits the model's vocabulary to a prepared
one) before any process starts, without importing torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, BinaryIO

from plait.errors import PlaitError
from plait.rules import DATA_FORMATS
from plait.train.data.records import is_records, readable

FORMAT, VERSION = "plait-tokens", 1
INDEX, TOKENS, TOKENIZER, VERIFIED = "index.json", "tokens.bin", "tokenizer.json", "verified.json"
DOCUMENTS = "documents.bin"  # each document's end in tokens.bin, little-endian uint64 (records only)
LOSS_MASK = "loss_mask.bin"  # one byte per token: 1 where it carries the loss (completion and chat data)
EDGE = 1 << 16  # bytes at each end of the token file hashed by the cheap check
CHUNK = 1 << 20  # the full hash reads into one buffer of this size, reused
ITEMSIZE = {"uint16": 2, "uint32": 4}


@dataclass(frozen=True)
class TokenIndex:
    """What index.json says of a prepared corpus."""

    dtype: str
    count: int
    vocab_size: int
    tokenizer: str  # "bytes", or the tokenizer.json it was encoded with
    source: str
    sha256: str
    edges_sha256: str
    format: str = FORMAT
    version: int = VERSION
    documents: int = 0  # records, each followed by `eos`; their ends are in documents.bin (0: a text stream)
    eos: int | None = None  # the id after each document
    documents_sha256: str = ""
    bad_records: int = 0  # records skipped, each named when prepared (plait/train/data/records.py)
    data_format: str = "text"  # text | completion | chat (plait data prepare --format)
    loss_mask: bool = False  # loss_mask.bin beside the tokens: which of them carry the loss

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(source: str) -> bool:
    """True when `source` is a directory written by `plait data prepare`."""
    return (Path(source) / INDEX).is_file() and (Path(source) / TOKENS).exists()


def read_index(directory: str | Path) -> TokenIndex:
    """index.json, checked for the fields and types plait needs; errors name the file."""
    path = Path(directory) / INDEX
    again = "prepare the corpus again with `plait data prepare`"
    try:
        raw = json.loads(path.read_text())
        index = TokenIndex(**{k: raw[k] for k in TokenIndex.__dataclass_fields__ if k in raw})
    except (OSError, ValueError, TypeError) as exc:
        raise PlaitError(f"{path} is not a readable plait token index ({type(exc).__name__})", hint=again) from None
    wrong = next((name for name, kind in _INDEX_KINDS.items() if not kind(getattr(index, name))), None)
    if wrong is not None:
        raise PlaitError(f"{path} is not a plait token index ({wrong} = {getattr(index, wrong)!r})", hint=again)
    if index.format != FORMAT or index.dtype not in ITEMSIZE:
        raise PlaitError(f"{path} is not a plait token index (format {index.format!r}, dtype {index.dtype!r})",
                         hint=again)
    return index


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_INDEX_KINDS = {  # each field of index.json and what it must be
    "dtype": lambda v: isinstance(v, str), "count": _count, "vocab_size": lambda v: _count(v) and v > 0,
    "tokenizer": lambda v: isinstance(v, str), "source": lambda v: isinstance(v, str),
    "sha256": lambda v: isinstance(v, str), "edges_sha256": lambda v: isinstance(v, str),
    "format": lambda v: isinstance(v, str), "version": _count, "documents": _count,
    "eos": lambda v: v is None or _count(v), "documents_sha256": lambda v: isinstance(v, str),
    "bad_records": _count, "data_format": lambda v: v in DATA_FORMATS, "loss_mask": lambda v: isinstance(v, bool),
}


def edges_digest(handle: BinaryIO, size: int) -> str:
    """sha256 of the first and last EDGE bytes (the whole file when it is smaller)."""
    digest = hashlib.sha256()
    handle.seek(0)
    digest.update(handle.read(min(EDGE, size)))
    if size > EDGE:
        handle.seek(max(EDGE, size - EDGE))
        digest.update(handle.read())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of the whole file, read in chunks into one buffer (resident memory: that buffer)."""
    digest, buffer = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def _damaged(path: Path, what: str) -> PlaitError:
    return PlaitError(f"token file {path} is damaged: {what}",
                      hint=f"prepare it again with `plait data prepare ... --out {path.parent}`")


def check_tokens(directory: str | Path, full: bool | None = None) -> TokenIndex:
    """The index of a prepared corpus whose token file passed the checks (see the module).

    `full=None` hashes the whole file only on the node's first rank (LOCAL_RANK 0), and only
    when verified.json does not already vouch for this size, mtime and hash.
    """
    directory = Path(directory)
    index, path = read_index(directory), directory / TOKENS
    try:
        stat = path.stat()
        if stat.st_size != index.nbytes:
            raise _damaged(path, f"{stat.st_size:,} bytes where the index says {index.count:,} "
                                 f"{index.dtype} tokens ({index.nbytes:,} bytes)")
        with open(path, "rb") as handle:
            if edges_digest(handle, stat.st_size) != index.edges_sha256:
                raise _damaged(path, "its first or last bytes differ from those prepared")
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": index.sha256}
        if full is None:
            full = os.environ.get("LOCAL_RANK", "0") == "0" and _read_stamp(directory) != stamp
        if full:
            if file_digest(path) != index.sha256:
                raise _damaged(path, "its sha256 differs from the index's")
            _write_stamp(directory, stamp)
    except OSError as exc:
        raise PlaitError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    return index


def _read_stamp(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / VERIFIED).read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(directory: Path, stamp: dict[str, Any]) -> None:
    """Best effort: a read-only corpus is hashed again next time, nothing worse."""
    tmp = directory / f".{VERIFIED}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, directory / VERIFIED)
    except OSError:
        tmp.unlink(missing_ok=True)


def write_index(directory: Path, index: TokenIndex) -> None:
    """index.json, atomically (a reader sees the old index or the new one, never half)."""
    tmp = directory / f".{INDEX}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(index), indent=1) + "\n")
    os.replace(tmp, directory / INDEX)


@dataclass(frozen=True)
class BlendPart:
    """One corpus of a blend (`--data 0.7:DIR_A,0.3:DIR_B`) and its share of every batch."""

    weight: float
    source: str


FINE_TUNING_FORMATS = ("completion", "chat")  # records whose documents --doc-mask auto keeps apart


def fine_tuning_corpus(source: str) -> bool:
    """Whether --data is a prepared corpus of prompts and completions, or of chats, with its
    documents' ends (a blend: any of its parts, which must all be packed alike): where
    `--doc-mask auto` masks the documents. Read off each index, before any token is."""
    parts = blend_parts(source)
    for corpus in [part.source for part in parts] if parts else [source]:
        if is_prepared(corpus):
            index = read_index(corpus)
            if index.documents and index.data_format in FINE_TUNING_FORMATS:
                return True
    return False


def blend_parts(source: str) -> list[BlendPart] | None:
    """The parts of a blend, or None when `source` is one corpus: a blend is comma-separated
    WEIGHT:CORPUS items (weights positive; they need not sum to 1: they are normalised)."""
    items = source.split(",")
    if not all(_weighted(item) for item in items):
        if len(items) > 1 and any(_weighted(item) for item in items):
            raise PlaitError(f"--data {source}: a blend names every corpus as WEIGHT:CORPUS",
                             hint="e.g. --data 0.7:data/web,0.3:data/code")
        return None
    parts = []
    for item in items:
        weight, _, corpus = item.partition(":")
        if not float(weight) > 0 or not corpus.strip():
            raise PlaitError(f"--data {source}: {item!r} needs a positive weight and a corpus",
                             hint="e.g. --data 0.7:data/web,0.3:data/code")
        parts.append(BlendPart(float(weight), corpus.strip()))
    if len({p.source for p in parts}) != len(parts):
        raise PlaitError(f"--data {source} names a corpus twice", hint="give each corpus once, with its whole weight")
    return parts


def _weighted(item: str) -> bool:
    weight, colon, _ = item.partition(":")
    try:
        return bool(colon) and float(weight) == float(weight)  # a number (not nan) before the colon
    except ValueError:
        return False


def lead_source(source: str) -> str:
    """The corpus whose tokenizer and vocabulary stand for `--data`: itself, or a blend's
    first part (every part shares them: checked by `check_blend`)."""
    parts = blend_parts(source)
    return parts[0].source if parts else source


def check_blend(source: str) -> None:
    """A blend's parts read alike: one vocabulary and one tokenizer, else refused naming both."""
    parts = blend_parts(source) or []
    seen = {(data_vocab(p.source), _tokenizer_of(p.source)): p.source for p in parts}
    if len(seen) > 1:
        (a_key, a), (b_key, b) = list(seen.items())[:2]
        raise PlaitError(f"--data blends corpora of different tokens: {a} (vocabulary {a_key[0]}, {a_key[1]}) and "
                         f"{b} (vocabulary {b_key[0]}, {b_key[1]})",
                         hint="prepare every part with the same --tokenizer (and the same kind: records or text)")


def _tokenizer_of(source: str) -> str:
    if not is_prepared(source):
        return "bytes"
    path = Path(source) / TOKENIZER
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "bytes"


def data_vocab(source: str) -> int:
    """The vocabulary a corpus's ids come from: its tokenizer's, or 256 for bytes."""
    return read_index(source).vocab_size if is_prepared(source) else 256


def model_for_data(model: str, source: str) -> str:
    """`--model`, with vocab_size following a prepared corpus unless the user set it (raw
    text and stdlib are bytes: any vocabulary of 256 or more reads them, as before).

    A vocabulary smaller than the data's cannot embed its ids: refused, naming both.
    """
    from plait.models.gpt.config import get_preset, parse_overrides

    source = lead_source(source)
    vocab = data_vocab(source)
    _, _, spec = model.partition(",")
    if "vocab_size" not in (parse_overrides(spec, model) if spec else {}) and is_prepared(source):
        if vocab != get_preset(model).vocab_size:
            model = f"{model},vocab_size={vocab}"
    elif get_preset(model).vocab_size < vocab:
        raise PlaitError(f"model {model!r} has vocab_size {get_preset(model).vocab_size}, fewer than the "
                         f"{vocab} token ids of --data {source}",
                         hint=f"drop vocab_size from --model (it follows the data), or set it to {vocab} or more")
    return model


class TextCodec:
    """Text <-> token ids for the prompt and the printed sample: bytes, or a tokenizer."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


def text_codec(source: str) -> TextCodec:
    """The codec of `--data`: the prepared corpus's tokenizer.json when it has one."""
    source = lead_source(source)
    path = Path(source) / TOKENIZER
    if not (is_prepared(source) and path.is_file()):
        return TextCodec()
    from tokenizers import Tokenizer

    return TextCodec(Tokenizer.from_file(str(path)))


# -- raw text: what `--data` may name besides a prepared corpus (checked before spawning) --------
EMBEDDED = "embedded"  # the corpus plait ships: the same bytes on every machine (the default)
EMBEDDED_FILE = Path(__file__).with_name("corpus.txt.gz")
STDLIB = "stdlib"  # the running Python's own source: larger, but it differs between Python versions
BUILTIN = (EMBEDDED, STDLIB)
SKIP_DIRS = {"test", "tests", "site-packages", "idle_test", "__pycache__"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}
RAW_LIMIT = 8 * 2**20  # raw text is read whole by every rank: beyond this, `plait data prepare`


def corpus_files(root: Path, suffixes: set[str]) -> Iterator[Path]:
    """Text files under `root` in a fixed (sorted, depth-first) order, so every rank reads
    the same bytes; lazily, so reading can stop once the corpus is large enough."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if Path(name).suffix in suffixes:
                yield readable(Path(dirpath) / name)


def builtin_files(source: str) -> Iterator[Path] | None:
    """The files of a built-in corpus, in the order plait reads them ('embedded': the shipped
    file; 'stdlib': the running interpreter's .py sources, lazily); None for any other source."""
    if source == EMBEDDED:
        return iter([EMBEDDED_FILE])
    if source == STDLIB:
        import sysconfig

        return corpus_files(Path(sysconfig.get_paths()["stdlib"]), {".py"})
    return None


def open_corpus_file(path: Path) -> BinaryIO:
    """A corpus file's bytes: the shipped corpus is stored gzipped, any other file as it is."""
    return gzip.open(path, "rb") if path.resolve() == EMBEDDED_FILE.resolve() else open(path, "rb")


def raw_files(source: str, max_bytes: int = RAW_LIMIT) -> list[Path]:
    """The files of a raw-text `--data`, refused when more than `max_bytes` in all: every rank
    would hold it in memory, so a larger corpus is prepared and mapped instead (never cut)."""
    path = Path(source)
    if not path.exists():
        raise PlaitError(f"corpus {source!r} does not exist", hint="give a text file, a directory, 'embedded' or 'stdlib'")
    if is_records(path):  # read as text, its JSON or parquet bytes would be the corpus
        raise PlaitError(f"--data {source} holds records (jsonl, parquet or a datasets folder): prepare them first, "
                         f"each record one document", hint=f"plait data prepare --tokenizer bytes --data {source} "
                                                           f"--out DIR, then --data DIR")
    files = list(corpus_files(path, TEXT_SUFFIXES)) if path.is_dir() else [path]
    total = sum(f.stat().st_size for f in files)
    if total > max_bytes:
        raise PlaitError(f"corpus {source!r} holds {total / 2**20:,.1f} MiB of text, more than the "
                         f"{max_bytes / 2**20:g} MiB plait reads into every rank's memory",
                         hint=f"tokenize it once into a file every rank maps: plait data prepare "
                              f"--tokenizer bytes --data {source} --out DIR, then --data DIR")
    return files
