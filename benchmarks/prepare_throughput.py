"""How fast `plait data prepare` turns jsonl records into tokens, against the tokenizer's own rate.

    python benchmarks/prepare_throughput.py                 # 64 MB of jsonl, and a 1 GB one for memory
    python benchmarks/prepare_throughput.py --mb 16 --big-mb 0 --no-write

Records are this Python's standard library sources cut into documents of about 4 KB (real
code and prose, no download), written as jsonl. A byte-level BPE tokenizer with a 16,384
vocabulary is trained on 8 MB of them once. Measured in one run, on the same records:

- the tokenizer library's own rate: `encode_batch` over batches of 1,024 documents, already
  in memory (its Rust threads use every core);
- `plait data prepare --workers 1` and `--workers 2`, as a user types them (subprocesses),
  reading the jsonl, encoding, and writing tokens.bin and documents.bin.

Goal: prepare at least 0.8x the library's rate. Also the peak memory of `prepare` on a 1 GB
jsonl (`--big-mb`), which must not grow with the file.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, publish  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = 4096


def documents(limit: int) -> list[str]:
    """About `limit` bytes of the stdlib's .py sources, as documents of about DOC bytes."""
    out, total = [], 0
    while total < limit:
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            text = path.read_text(errors="replace")
            for i in range(0, len(text), DOC):
                piece = text[i:i + DOC]
                if piece.strip():
                    out.append(piece)
                    total += len(piece)
                if total >= limit:
                    return out
    return out


def write_jsonl(path: Path, docs: list[str], size: int = 0) -> int:
    """`docs` as jsonl, once, or repeated until the file holds `size` bytes; the records written."""
    count, written = 0, 0
    with open(path, "w") as handle:
        while count == 0 or written < size:
            for text in docs:
                line = json.dumps({"text": text}) + "\n"
                handle.write(line)
                written += len(line)
                count += 1
                if size and written >= size:
                    break
    return count


def tokenizer(directory: Path, docs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16384, show_progress=False, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def library_rate(directory: Path, docs: list[str]) -> tuple[float, int]:
    """(tokens/s, tokens) of encode_batch over the documents, 1,024 at a time, in memory."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(docs), 1024):
        tokens += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + 1024], add_special_tokens=False))
    return tokens / (time.perf_counter() - start), tokens


RUNNER = """import json, resource, sys
from plait.cli import main
code = main(sys.argv[1:])
peaks = [resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(json.dumps({"peak_kib": max(peaks)}), file=sys.stderr)
sys.exit(code)
"""


def prepare(source: Path, tok: Path, out: Path, workers: int) -> dict:
    """`plait data prepare` in a subprocess: seconds, tokens, and the peak resident memory of
    its largest process (itself, or a worker)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RUNNER, "data", "prepare", "--tokenizer", str(tok), "--data",
                           str(source), "--out", str(out), "--workers", str(workers)],
                          capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(proc.stderr)
    index = json.loads((out / "index.json").read_text())
    peak = json.loads(proc.stderr.strip().splitlines()[-1])["peak_kib"]
    return {"seconds": seconds, "tokens": index["count"], "documents": index["documents"], "peak_mib": peak / 1024}


def drive(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="plait-prepare-"))
    docs = documents(args.mb * 10**6)
    tokenizer(work / "tok", docs[: max(1, len(docs) * 8 // max(args.mb, 8))])
    source = work / "records.jsonl"
    write_jsonl(source, docs)
    rate, tokens = library_rate(work / "tok", docs)
    result = {"mb": args.mb, "library": rate, "library_tokens": tokens, "runs": {}}
    for workers in (1, 2):
        run = prepare(source, work / "tok", work / f"out{workers}", workers)
        run["rate"] = run["tokens"] / run["seconds"]
        result["runs"][workers] = run
        print(workers, run, flush=True)
    source.unlink()
    if args.big_mb:
        big = work / "big.jsonl"
        result["big_records"] = write_jsonl(big, docs, args.big_mb * 10**6)
        result["big"] = prepare(big, work / "tok", work / "outbig", 2)
        result["big_mb"] = args.big_mb
        big.unlink()
    os.system(f"rm -rf {work}")
    return result


def table(result: dict, args) -> str:
    lines = [
        "### `plait data prepare` on jsonl records: tokens/s against the tokenizer library's own rate",
        "",
        f"- command: `python benchmarks/prepare_throughput.py --mb {args.mb} --big-mb {args.big_mb}`",
        f"- machine: {machine()}; date: {datetime.date.today().isoformat()}",
        f"- records: the stdlib's .py sources cut into ~4 KB documents, {result['mb']} MB of text as jsonl; a byte-level "
        "BPE tokenizer of 16,384 ids trained on them; the library's rate is `encode_batch` over the same "
        "documents in memory (1,024 a call, its threads on every core); prepare reads the jsonl, encodes and "
        "writes tokens.bin and documents.bin (its tokens count one EOS a document more); goal: at least 0.8× "
        "the library",
        "",
        "| what | tokens | seconds | tokens/s | × library | peak MiB |",
        "|---|---|---|---|---|---|",
        f"| tokenizers `encode_batch` | {result['library_tokens']:,} | "
        f"{result['library_tokens'] / result['library']:.1f} | {result['library']:,.0f} | 1.00 | — |",
    ]
    for workers, run in result["runs"].items():
        peak = f"{run['peak_mib']:,.0f}"
        lines.append(f"| `plait data prepare --workers {workers}` | {run['tokens']:,} | {run['seconds']:.1f} | "
                     f"{run['rate']:,.0f} | {run['rate'] / result['library']:.2f} | {peak} |")
    return "\n".join(lines + (["", memory_line(result)] if result.get("big") else []))


def memory_line(result: dict) -> str:
    """The 1 GB file's time and peak memory, beside the small file's."""
    big = result["big"]
    rate = big["tokens"] / big["seconds"]
    return (f"On a {result['big_mb']:,} MB jsonl ({result['big_records']:,} records, {big['tokens']:,} tokens, "
            f"`--workers 2`): {big['seconds']:.0f} s, {rate:,.0f} tokens/s, peak resident memory "
            f"{big['peak_mib']:,.0f} MiB (the largest process: the main one or a worker), as on the "
            f"{result['mb']} MB file.")


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--mb", type=int, default=64, help="MB of jsonl for the rates")
    parser.add_argument("--big-mb", type=int, default=1000, help="MB of jsonl for the memory figure (0: skip)")
    args = parser.parse_args()
    publish("prepare_throughput", table(drive(args), args), args)


if __name__ == "__main__":
    main()
